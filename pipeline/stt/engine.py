"""Continuous-batching streaming recogniser on a cache-aware FastConformer RNNT.

Every slot (stream) owns explicit state in batched tensors: the mel pre-encode cache, the
encoder's attention/convolution caches and the prediction network's LSTM state and output.
One ``step()`` advances every stream that has a full chunk with one encoder call and one
batched greedy decode; streams join and leave between steps. The slots' state is typed
(``pipeline/stt/slots.py``: :class:`SlotState` on the device, a :class:`SlotStream` per stream
on the host), and how audio is cut into chunks is the model's :class:`Framing`
(``pipeline/stt/framing.py``), so streaming tokens equal an offline pass.
"""
from __future__ import annotations

import numpy as np
import torch

from pipeline.audio_constants import USER_RATE
from pipeline.engines import NoFreeSlot
from pipeline.stt.config import STTConfig
from pipeline.stt.decoding import PredictionStep, frame_loop_decode_chunk, label_loop_decode_chunk
from pipeline.stt.encoder import KVCacheLayersStep, NemoLayersStep
from pipeline.stt.features import ChunkFeatures
from pipeline.stt.framing import Framing
from pipeline.stt.languages import Languages, prompted
from pipeline.stt.slots import SlotState, SlotStream, STTEvent
from pipeline.stt.subsampling import CausalDwStriding

__all__ = ["STTEngine", "STTEvent", "NoFreeSlot", "word_timings"]


def word_timings(tokenizer, tokens: list[int], frames: list[int], frame_ms: int) -> list[dict]:
    """Words of a token sequence with times from the encoder frame each token was emitted on.

    A word starts at a SentencePiece piece beginning with "▁" (or at the first token); it spans
    from its first token's frame to the end of its last token's frame, in ms from the start of the
    utterance. RNNT emission frames trail the sound a little; the resolution is one frame (80 ms)."""
    if not tokens or not hasattr(tokenizer, "ids_to_tokens"):
        return []
    pieces = tokenizer.ids_to_tokens(tokens)
    groups: list[list[int]] = []
    for i, piece in enumerate(pieces):
        if not groups or piece.startswith("\u2581"):
            groups.append([])
        groups[-1].append(i)
    words = []
    for g in groups:
        word = tokenizer.ids_to_text([tokens[i] for i in g]).strip()
        if word:
            words.append({"word": word, "start_ms": frames[g[0]] * frame_ms, "end_ms": (frames[g[-1]] + 1) * frame_ms})
    return words


class STTEngine:
    sample_rate = USER_RATE

    def __init__(self, model, cfg: STTConfig):
        self.model, self.cfg, self.num_slots = model.eval(), cfg, cfg.num_slots
        self.framing = Framing.of(model, cfg)  # checks that this model streams exactly
        self.enc, self.preprocessor, self.tokenizer = model.encoder, model.preprocessor, model.tokenizer
        self.device, self.dtype = next(model.parameters()).device, next(model.parameters()).dtype
        self.languages = Languages.of(model)  # what it speaks; a language-prompted model's prompt per slot
        self.languages.check_offered(cfg.heard())
        self._features = ChunkFeatures(model.preprocessor)
        fast_pre = cfg.fast_subsampling and CausalDwStriding.supports(self.enc.pre_encode)
        self._fast_pre = CausalDwStriding(self.enc.pre_encode) if fast_pre else None
        self.blank = model.decoder.blank_idx
        self.max_symbols = int((model.cfg.decoding.get("greedy", {}) or {}).get("max_symbols", None) or 10)
        self.pred = PredictionStep(model.decoder, unrolled=cfg.unrolled_lstm)
        self._decode_chunk = label_loop_decode_chunk if cfg.decoder == "label_loop" else frame_loop_decode_chunk
        kv = cfg.kv_cache and KVCacheLayersStep.supports(self.enc)
        self.enc_step = KVCacheLayersStep(self.enc) if kv else NemoLayersStep(self.enc)
        self.state = SlotState.create(self.enc_step.cache_shapes(), self.num_slots, self.enc._feat_in,
                                      self.framing.pre_cache, self.pred, model.joint, self.blank,
                                      self.framing.mel_zero, self.dtype, self.device)
        self._streams: dict[str, SlotStream] = {}
        self._free = list(range(self.num_slots))
        self._idx_cache: dict[tuple, torch.Tensor] = {}
        self._layers = self._compile_layers() if cfg.compile else self.enc_step.__call__

    def _compile_layers(self):
        """The encoder layers under torch.compile, static shapes: one graph per batch width.

        Dynamo keeps at most ``recompile_limit`` graphs per function (8 by default) and runs
        every shape past that eagerly, silently; so the limit is raised to cover all widths
        (a little margin for the odd guard-driven recompile)."""
        need = self.num_slots + 2
        for name in ("recompile_limit", "cache_size_limit"):
            if getattr(torch._dynamo.config, name, need) < need:
                setattr(torch._dynamo.config, name, need)
        return torch.compile(self.enc_step.__call__, dynamic=False, backend=self.cfg.compile_backend)

    @classmethod
    def from_config(cls, cfg: STTConfig) -> "STTEngine":
        from pipeline.stt.model import load_model

        return cls(load_model(cfg), cfg)

    # ------------------------------------------------------------------ stream lifecycle
    @property
    def active_streams(self) -> list[str]:
        return list(self._streams)

    def open(self, stream_id: str, language: str | None = None) -> None:
        """A new stream in a free slot, heard as ``language`` (a code of ``languages.codes``; None:
        the model's default, "auto" where it detects); ValueError for a language it does not speak."""
        if stream_id in self._streams:
            raise ValueError(f"STT stream {stream_id!r} is already open")
        prompt = self.languages.index(language)
        if not self._free:
            raise NoFreeSlot(
                f"all {self.num_slots} STT slots are in use; close a stream or raise STTConfig.num_slots"
            )
        slot = self._free.pop(0)
        rows = self._index([slot])
        self.state.reset(rows)
        self.state.prompt.index_fill_(0, rows, prompt)
        self._streams[stream_id] = SlotStream(stream_id, slot)

    def fork(self, stream_id: str, fork_id: str) -> None:
        """Open ``fork_id`` as a copy of ``stream_id`` as it is now, in a free slot: its device
        state and its host bookkeeping. Ending the copy gives the transcript the stream would end
        with now, while the stream itself goes on untouched. Raises NoFreeSlot with no slot free."""
        src = self._get(stream_id)
        if fork_id in self._streams:
            raise ValueError(f"STT stream {fork_id!r} is already open")
        if not self._free:
            raise NoFreeSlot(f"all {self.num_slots} STT slots are in use: no slot to copy a stream into")
        slot = self._free.pop(0)
        self.state.copy(self._index([src.slot]), self._index([slot]))
        self._streams[fork_id] = src.forked(fork_id, slot)

    def reset(self) -> None:
        """Every stream closed, every slot in its start state."""
        self._streams, self._free = {}, list(range(self.num_slots))
        self.state.reset(self._index(self._free))

    def close(self, stream_id: str) -> None:
        st = self._streams.pop(stream_id, None)
        if st is not None:
            self._free.append(st.slot)
            self._free.sort()

    def feed(self, stream_id: str, pcm: np.ndarray) -> None:
        st = self._get(stream_id)
        pcm = np.asarray(pcm, dtype=np.float32).reshape(-1)
        if pcm.size and st.ending:
            raise RuntimeError(f"STT stream {stream_id!r} was ended; wait for its final event")
        if pcm.size:
            st.buf = np.concatenate([st.buf, pcm])
            st.total += pcm.size

    def end(self, stream_id: str) -> None:
        """Mark the utterance complete. The steps that follow decode its remainder (its last,
        short chunk batched with other streams' chunks) and then return its "final" event with
        the whole text, tokens and word times; the stream stays open, reset for a new utterance.
        This is the one way an utterance ends: serving, tests and benchmarks all use it."""
        self._get(stream_id).ending = True

    def pending(self) -> bool:
        return any(st.ending or self.framing.has_chunk(st) for st in self._streams.values())

    def step(self) -> list[STTEvent]:
        """Advance every stream with a full chunk (or an ended one) by one chunk, in one batch."""
        ready, last, done = [], [], []
        for st in self._streams.values():
            if self.framing.has_chunk(st):
                ready.append(st)
                last.append(False)
            elif st.ending:
                done.append(st)
                if self.framing.has_tail(st):
                    ready.append(st)
                    last.append(True)
        if ready:
            self._advance(ready, last)
        events: list[STTEvent] = []
        for st in ready:
            events.extend(st.events(self._text, self.cfg.endpoint_ms, self.framing.frame_ms))
        if done:
            self.state.reset(self._index([st.slot for st in done]))
        for st in done:
            text = self._text(st.tokens)
            words = word_timings(self.tokenizer, *self.languages.text_tokens(st.tokens, st.token_frames),
                                 self.framing.frame_ms)
            events.append(STTEvent(st.id, "final", text, list(st.tokens), words))
            st.reset()
        return events

    def _text(self, tokens: list[int]) -> str:
        """The text of ``tokens``: language tags left out."""
        kept = self.languages.text_tokens(tokens)
        return self.tokenizer.ids_to_text(kept) if kept else ""

    # ------------------------------------------------------------------ offline reference, warm-up
    def transcribe_offline_tokens(self, pcm: np.ndarray, language: str | None = None) -> list[int]:
        from pipeline.stt.reference import offline_tokens

        return offline_tokens(self.model, pcm, language)

    def warmup(self) -> None:
        """Run every shape the engine steps with before serving (``pipeline/stt/warmup.py``)."""
        from pipeline.stt.warmup import warm

        warm(self)

    # ------------------------------------------------------------------ the batched step
    def _get(self, stream_id: str) -> SlotStream:
        try:
            return self._streams[stream_id]
        except KeyError:
            raise KeyError(f"STT stream {stream_id!r} is not open") from None

    def _index(self, slots: list[int]) -> torch.Tensor:
        key = tuple(slots)
        idx = self._idx_cache.get(key)
        if idx is None:
            idx = torch.tensor(slots, dtype=torch.long, device=self.device)
            if len(self._idx_cache) < 4096:
                self._idx_cache[key] = idx
        return idx

    @torch.inference_mode()
    def _advance(self, streams: list[SlotStream], last: list[bool]) -> None:
        """One chunk of each of ``streams`` through the model, all in one batch (``last[b]``: the
        stream's final, short chunk), in four stages."""
        idx = self._index([st.slot for st in streams])
        first = [st.next_frame == 0 and not self.framing.nemo for st in streams]
        mel, n_frames = self._chunk_features(streams, last)
        pre, pre_len = self._pre_encode_chunks(mel, n_frames, first, idx)
        enc_out, enc_len = self._encode(pre, pre_len, idx)
        self._decode(streams, enc_out, enc_len, idx)

    def _chunk_features(self, streams: list[SlotStream], last: list[bool]) -> tuple[torch.Tensor, list[int]]:
        """Stage 1: each chunk's raw audio (consumed from its stream) to mel frames, in one
        preprocessor call. Returns the chunks' new frames [B, F, span] and each one's frame count."""
        f = self.framing
        segs, n_frames = zip(*(f.segment(st, ls) for st, ls in zip(streams, last)))
        seg_len = np.array([len(seg) for seg in segs])
        width = int(seg_len.max())
        if f.nemo:  # NeMo zero-pads every frame to the full chunk
            width = (f.ctx + f.n_next) * f.hop
        audio = np.zeros((len(segs), width), np.float32)
        for b, seg in enumerate(segs):
            audio[b, : len(seg)] = seg
        x = torch.from_numpy(audio).to(self.device, torch.float32, non_blocking=True)  # features in float32, as NeMo
        x_len = torch.from_numpy(seg_len).to(self.device)
        feats = self._features(x, x_len, full=bool((seg_len == width).all()))
        span = max(max(n_frames), f.n_next)
        if feats.shape[-1] < f.ctx + span:
            feats = torch.nn.functional.pad(feats, (0, f.ctx + span - feats.shape[-1]))
        return feats[:, :, f.ctx : f.ctx + span], list(n_frames)

    def _pre_encode_chunks(
        self, mel: torch.Tensor, n_frames: list[int], first: list[bool], idx: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Stage 2: causal conv subsampling, masked by length, and the mel pre-encode cache shift.

        First chunks have no cache and drop nothing; later chunks run on [mel cache | chunk] and
        drop the extra frames. Both groups have fixed widths; last chunks ride along shorter (their
        padding is masked out). Returns [B, T, D] padded to a fixed T (static shapes for
        torch.compile), rows in the order of ``mel``, and their lengths."""
        # Over 40 lines as one function: the two groups of one batch (first and later chunks), then one shift.
        B = mel.shape[0]
        n_t = torch.tensor(n_frames, dtype=torch.long, device=self.device)
        pre_parts, len_parts, order = [], [], []
        for is_first in (True, False):
            rows = [b for b in range(B) if first[b] == is_first]
            if not rows:
                continue
            r = self._index(rows)
            if is_first:
                x_g = mel.index_select(0, r)[:, :, : self.framing.n_first]
                full = all(n_frames[b] >= self.framing.n_first for b in rows)
                o, ol = self._pre_encode(x_g.transpose(1, 2), n_t.index_select(0, r), full)
                ol = ol.long()
            else:
                x_g = torch.cat(
                    [self.state.mel_cache.index_select(0, idx.index_select(0, r)), mel.index_select(0, r)[:, :, : self.framing.n_next]],
                    dim=-1,
                )
                full = all(n_frames[b] >= self.framing.n_next for b in rows)
                o, ol = self._pre_encode(x_g.transpose(1, 2), n_t.index_select(0, r) + self.framing.pre_cache, full)
                o, ol = o[:, self.framing.drop_extra :], (ol.long() - self.framing.drop_extra).clamp(min=0)
            pre_parts.append(o)
            len_parts.append(ol)
            order += rows
        self._shift_mel_cache(mel, n_t, idx)
        T = max(self.framing.out_len, max(p.shape[1] for p in pre_parts))
        pre = torch.cat([torch.nn.functional.pad(p, (0, 0, 0, T - p.shape[1])) for p in pre_parts], 0)
        pre_len = torch.cat(len_parts, 0)
        if order != list(range(B)):  # back to the order of `streams`
            inv = self._index([order.index(b) for b in range(B)])
            pre, pre_len = pre.index_select(0, inv), pre_len.index_select(0, inv)
        return pre, pre_len

    def _shift_mel_cache(self, mel: torch.Tensor, n_t: torch.Tensor, idx: torch.Tensor) -> None:
        """Keep the last ``pre_cache`` mel frames of [cache | this chunk]: one gather, one scatter."""
        tail_pos = n_t[:, None] + torch.arange(self.framing.pre_cache, device=self.device)[None, :]
        both = torch.cat([self.state.mel_cache.index_select(0, idx), mel], dim=-1)
        self.state.mel_cache.index_copy_(0, idx, torch.gather(both, 2, tail_pos[:, None, :].expand(-1, both.shape[1], -1)))

    def _encode(self, pre: torch.Tensor, pre_len: torch.Tensor, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Stage 3: the encoder layers, one (compiled) call for the whole batch on the slots'
        gathered caches; the updated caches are scattered back."""
        enc_out, enc_len, caches, ch_len = self._layers(
            pre,
            pre_len,
            [cache.index_select(1, idx) for cache in self.state.caches],
            self.state.cache_len.index_select(0, idx),
            pos=self.enc_step.positions(pre.shape[1]),
        )
        for cache, new in zip(self.state.caches, caches):
            cache.index_copy_(1, idx, new)
        self.state.cache_len.index_copy_(0, idx, ch_len)
        if self.languages.prompted:
            enc_out = prompted(self.model.prompt_kernel, enc_out, self.state.prompt.index_select(0, idx),
                               self.languages.num_prompts)
        return enc_out, enc_len

    def _decode(self, streams: list[SlotStream], enc_out: torch.Tensor, enc_len: torch.Tensor, idx: torch.Tensor) -> None:
        """Stage 4: greedy RNNT over the chunk with each slot's carried prediction-net state, then
        the step's one device-to-host transfer (labels, their frames, frame counts) into the streams."""
        f = self.model.joint.project_encoder(enc_out.transpose(1, 2))
        labels, frames, g, hc = self._decode_chunk(
            self.model.joint,
            self.pred,
            self.blank,
            self.max_symbols,
            f,
            enc_len,
            self.state.g.index_select(0, idx),
            self.state.hc.index_select(1, idx),
        )
        self.state.g.index_copy_(0, idx, g)
        self.state.hc.index_copy_(1, idx, hc)
        host = torch.cat([labels, frames, enc_len[:, None]], 1).cpu().numpy()
        I = labels.shape[1]
        for b, st in enumerate(streams):
            st.record(host[b, :I], host[b, I : 2 * I], int(host[b, 2 * I]))

    def _pre_encode(self, x: torch.Tensor, lengths: torch.Tensor, full: bool = False):
        """``enc.pre_encode(x, lengths)``: the channels-last matmul form when the encoder's subsampling
        is causal dw_striding (``pipeline/stt/subsampling.py``), else NeMo's module. ``full``: every
        row is known (on the host) to be full-length, so no time masks are needed."""
        if self._fast_pre is not None:
            return self._fast_pre(x, lengths, full)
        return self.enc.pre_encode(x=x, lengths=lengths)
