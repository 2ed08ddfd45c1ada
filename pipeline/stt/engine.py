"""Continuous-batching streaming recogniser on a cache-aware FastConformer RNNT.

Every slot (stream) owns explicit state in batched tensors: the mel pre-encode cache, the
encoder's attention/convolution caches and the prediction network's LSTM state and output.
One ``step()`` advances every stream that has a full chunk with one encoder call and one
batched greedy decode; streams join and leave between steps. Features are computed per chunk
from the raw audio with two frames of left context, which reproduces the offline mel frames
(same pre-emphasis, same centred STFT windows), so streaming tokens equal an offline pass.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from pipeline.audio_constants import USER_RATE
from pipeline.stt.config import STTConfig
from pipeline.stt.decoding import PredictionStep, frame_loop_decode_chunk, label_loop_decode_chunk
from pipeline.engines import NoFreeSlot
from pipeline.stt.encoder import KVCacheLayersStep, NemoLayersStep
from pipeline.stt.features import ChunkFeatures
from pipeline.stt.subsampling import CausalDwStriding

_CTX_FRAMES = 2  # mel frames of left audio context per chunk (window 512 > hop 160 * 2 + 1 pre-emphasis sample)


@dataclass
class STTEvent:
    stream_id: str
    kind: str  # "partial" (text = delta) | "endpoint" | "final" (text = the whole utterance, after end())
    text: str = ""
    tokens: Optional[list[int]] = None  # "final" only
    words: Optional[list[dict]] = None  # "final" only: [{"word", "start_ms", "end_ms"}]


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


class _Stream:
    """Host-side bookkeeping of one slot (audio not yet consumed, tokens of the utterance)."""

    def __init__(self, stream_id: str, slot: int):
        self.id = stream_id
        self.slot = slot
        self.reset()

    def reset(self) -> None:
        self.buf = np.zeros(0, np.float32)
        self.buf_start = 0  # absolute sample index of buf[0]
        self.total = 0  # samples fed this utterance
        self.next_frame = 0  # next mel frame to encode
        self.enc_frames = 0  # encoder frames decoded this utterance
        self.tokens: list[int] = []
        self.token_frames: list[int] = []  # encoder frame (from the utterance start) of each token
        self.text = ""
        self.last_token_frame = -1
        self.endpointed = False
        self.ending = False  # end() called: the next step decodes the remainder as the last chunk

    def record(self, labels: np.ndarray, frames: np.ndarray, n_frames: int) -> None:
        """Take one chunk's decoding: labels (-1: none) with their frames in the chunk, and the
        chunk's encoder frame count."""
        emitted = labels >= 0
        if emitted.any():
            self.tokens.extend(int(v) for v in labels[emitted])
            self.token_frames.extend(self.enc_frames + int(v) for v in frames[emitted])
            self.last_token_frame = self.enc_frames + int(frames[emitted][-1])
            self.endpointed = False
        self.enc_frames += n_frames


class STTEngine:
    sample_rate = USER_RATE

    def __init__(self, model, cfg: STTConfig):
        self.model = model.eval()
        self.cfg = cfg
        enc = model.encoder
        enc.set_default_att_context_size(list(cfg.att_context_size))
        sc = enc.streaming_cfg
        self.enc = enc
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        pp = model.preprocessor.featurizer
        self.hop = int(pp.hop_length)
        if getattr(pp, "stft_pad_amount", None) is not None or int(pp.n_fft) // 2 >= self.hop * (_CTX_FRAMES + 1):
            raise NotImplementedError("chunked features need a centred STFT with n_fft/2 < 3 hops")
        if str(model.cfg.preprocessor.get("normalize", "NA")).lower() not in ("na", "none"):
            raise NotImplementedError("cache-aware streaming needs un-normalised features (preprocessor.normalize: NA)")
        if not isinstance(sc.chunk_size, list) or not isinstance(sc.pre_encode_cache_size, list):
            raise NotImplementedError("expects a causal-downsampling cache-aware encoder (list-valued chunk sizes)")
        if getattr(model.joint, "num_extra_outputs", 0):
            raise NotImplementedError("TDT / multi-output joints are not supported by the greedy RNNT step")
        self.preprocessor = model.preprocessor
        self._features = ChunkFeatures(model.preprocessor)
        fast_pre = cfg.fast_subsampling and CausalDwStriding.supports(enc.pre_encode)
        self._fast_pre = CausalDwStriding(enc.pre_encode) if fast_pre else None
        self.n_first, self.n_next = sc.chunk_size  # mel frames: first chunk, later chunks
        self.nemo_framing = cfg.framing == "nemo"
        self._ctx = 1 if self.nemo_framing else _CTX_FRAMES  # mel frames of left audio context per chunk
        self._mel_zero = 0.0
        if self.nemo_framing:  # NeMo's pipeline: every chunk full-size, after a pre-encode cache of silence
            from nemo.collections.asr.inference.utils.constants import LOG_MEL_ZERO

            self.n_first = self.n_next
            self._mel_zero = float(LOG_MEL_ZERO)
        self.pre_cache = sc.pre_encode_cache_size[1]
        self.drop_extra = sc.drop_extra_pre_encoded
        self.out_len = sc.valid_out_len  # encoder frames per chunk
        self.frame_ms = enc.subsampling_factor * self.hop * 1000 // self.sample_rate
        self.blank = model.decoder.blank_idx
        greedy = model.cfg.decoding.get("greedy", {}) or {}
        self.max_symbols = int(greedy.get("max_symbols", None) or 10)
        self.pred = PredictionStep(model.decoder, unrolled=cfg.unrolled_lstm)
        self.tokenizer = model.tokenizer
        self._decode_chunk = label_loop_decode_chunk if cfg.decoder == "label_loop" else frame_loop_decode_chunk
        S = cfg.num_slots
        self.num_slots = S
        # --- per-slot device state ---
        # encoder caches, [L, slot, ...] each: projected keys/values + conv inputs (KVCacheLayersStep),
        # or NeMo's cache_last_channel/cache_last_time; plus cache_last_channel_len [slot]
        kv = cfg.kv_cache and KVCacheLayersStep.supports(enc)
        self.enc_step = KVCacheLayersStep(enc) if kv else NemoLayersStep(enc)
        self.caches = [
            torch.zeros((shape[0], S, *shape[2:]), dtype=self.dtype, device=self.device)
            for shape in self.enc_step.cache_shapes()
        ]
        self.cache_len = torch.zeros(S, dtype=torch.long, device=self.device)
        self.mel_cache = torch.full(
            (S, enc._feat_in, self.pre_cache), self._mel_zero, dtype=self.dtype, device=self.device
        )
        L, H = self.pred.num_layers, self.pred.hidden
        self.hc = torch.zeros(2 * L, S, H, dtype=self.dtype, device=self.device)  # LSTM h of each layer, then c
        with torch.inference_mode():
            # start state = after feeding <SOS> (= blank, a zero embedding) to a zero LSTM state, as NeMo does
            g0, hc0 = self.pred(
                torch.full((1,), self.blank, dtype=torch.long, device=self.device), self.hc[:, :1].clone()
            )
            self.g0 = model.joint.project_prednet(g0)[0]
            self.hc0 = hc0[:, 0]  # [2L, H]
        self.g = self.g0.expand(S, -1).clone()
        self.hc[:] = self.hc0[:, None]
        # --- host bookkeeping ---
        self._streams: dict[str, _Stream] = {}
        self._free = list(range(S))
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

    def open(self, stream_id: str) -> None:
        if stream_id in self._streams:
            raise ValueError(f"STT stream {stream_id!r} is already open")
        if not self._free:
            raise NoFreeSlot(
                f"all {self.num_slots} STT slots are in use; close a stream or raise STTConfig.num_slots"
            )
        slot = self._free.pop(0)
        self._reset_slots([slot])
        self._streams[stream_id] = _Stream(stream_id, slot)

    @torch.inference_mode()
    def fork(self, stream_id: str, fork_id: str) -> None:
        """Open ``fork_id`` as a copy of ``stream_id`` as it is now, in a free slot: its device
        state (the rows ``_reset_slots`` covers) and its host bookkeeping. Ending the copy gives
        the transcript the stream would end with now, while the stream itself goes on untouched.
        Raises NoFreeSlot with no slot free."""
        src = self._get(stream_id)
        if fork_id in self._streams:
            raise ValueError(f"STT stream {fork_id!r} is already open")
        if not self._free:
            raise NoFreeSlot(f"all {self.num_slots} STT slots are in use: no slot to copy a stream into")
        slot = self._free.pop(0)
        s, d = self._index([src.slot]), self._index([slot])
        for cache in self.caches:
            cache[:, d] = cache[:, s]
        self.cache_len[d] = self.cache_len[s]
        self.mel_cache[d] = self.mel_cache[s]
        self.hc[:, d] = self.hc[:, s]
        self.g[d] = self.g[s]
        copy = _Stream(fork_id, slot)
        copy.__dict__.update({k: v for k, v in vars(src).items() if k not in ("id", "slot")})
        copy.buf, copy.tokens, copy.token_frames = src.buf.copy(), list(src.tokens), list(src.token_frames)
        self._streams[fork_id] = copy

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
        return any(st.ending or self._has_chunk(st) for st in self._streams.values())

    def step(self) -> list[STTEvent]:
        """Advance every stream with a full chunk (or an ended one) by one chunk, in one batch."""
        ready, last, done = [], [], []
        for st in self._streams.values():
            if self._has_chunk(st):
                ready.append(st)
                last.append(False)
            elif st.ending:
                done.append(st)
                if self._has_tail(st):
                    ready.append(st)
                    last.append(True)
        if ready:
            self._advance(ready, last)
        events: list[STTEvent] = []
        for st in ready:
            events.extend(self._events(st))
        if done:
            self._reset_slots([st.slot for st in done])
        for st in done:
            text = self.tokenizer.ids_to_text(st.tokens) if st.tokens else ""
            events.append(STTEvent(st.id, "final", text, list(st.tokens), self._words(st)))
            st.reset()
        return events

    def _words(self, st: _Stream) -> list[dict]:
        return word_timings(self.tokenizer, st.tokens, st.token_frames, self.frame_ms)

    # ------------------------------------------------------------------ offline reference
    def transcribe_offline_tokens(self, pcm: np.ndarray) -> list[int]:
        from pipeline.stt.reference import offline_tokens

        return offline_tokens(self.model, pcm)

    def warmup(self) -> None:
        """Run every shape the engine steps with (each batch width; first/later/last chunks).

        Call before serving: with ``cfg.compile`` this compiles one graph per batch width, and
        then sets torch's compiler stance to ``cfg.stance_after_warmup``, so that nothing compiles
        later. It runs under the default stance whatever another engine of this process set (a
        stance that stops recompiles would leave all widths but the first uncompiled). It uses
        (and then resets) all slots, so no stream may be open.
        """
        if self._streams:
            raise RuntimeError("STTEngine.warmup() must run before any stream is opened")
        if not self.cfg.compile:
            self._run_every_width()
            return
        with torch.compiler.set_stance("default"):
            self._run_every_width()
        if self.cfg.stance_after_warmup != "default":
            torch.compiler.set_stance(self.cfg.stance_after_warmup)

    def _run_every_width(self) -> None:
        rng = np.random.default_rng(0)
        need = (self.n_first + self.n_next - 1) * self.hop + 2 * self.hop
        try:
            for width in range(1, self.num_slots + 1):
                ids = [f"__warmup{i}" for i in range(width)]
                for sid in ids:
                    self.open(sid)
                    self.feed(sid, 0.01 * rng.standard_normal(need).astype(np.float32))
                self.step()  # first chunks
                self.step()  # later chunks
                self.end(ids[0])
                while self.pending():
                    self.step()  # a last chunk
                for sid in ids:
                    self.close(sid)
        finally:
            self._streams, self._free = {}, list(range(self.num_slots))
            self._reset_slots(list(range(self.num_slots)))

    # ------------------------------------------------------------------ internals
    def _get(self, stream_id: str) -> _Stream:
        try:
            return self._streams[stream_id]
        except KeyError:
            raise KeyError(f"STT stream {stream_id!r} is not open") from None

    def _chunk_frames(self, st: _Stream) -> int:
        return self.n_first if st.next_frame == 0 else self.n_next

    def _has_chunk(self, st: _Stream) -> bool:
        n = self._chunk_frames(st)
        if self.nemo_framing:
            return st.total >= (st.next_frame + n) * self.hop
        return st.total >= (st.next_frame + n - 1) * self.hop + self._half_window()

    def _has_tail(self, st: _Stream) -> bool:
        """Audio left for a last (short) chunk: at least one mel frame (NeMo's count is samples // hop)."""
        return st.total // self.hop > st.next_frame

    def _half_window(self) -> int:
        return int(self.preprocessor.featurizer.n_fft) // 2

    def _index(self, slots: list[int]) -> torch.Tensor:
        key = tuple(slots)
        idx = self._idx_cache.get(key)
        if idx is None:
            idx = torch.tensor(slots, dtype=torch.long, device=self.device)
            if len(self._idx_cache) < 4096:
                self._idx_cache[key] = idx
        return idx

    @torch.inference_mode()
    def _reset_slots(self, slots: list[int]) -> None:
        idx = self._index(slots)
        for cache in self.caches:
            cache[:, idx] = 0
        self.cache_len[idx] = 0
        self.mel_cache[idx] = self._mel_zero
        self.hc[:, idx] = self.hc0[:, None]
        self.g[idx] = self.g0

    def _segment(self, st: _Stream, last: bool) -> tuple[np.ndarray, int]:
        """Raw audio of the next chunk with _CTX_FRAMES frames of left context; and its frame count."""
        ctx = self._ctx * self.hop
        start = st.next_frame * self.hop - ctx
        if self.nemo_framing:  # [chunk start - 1 hop, chunk end): NeMo's BatchedCacheFeatureBufferer
            end = min(st.total, (st.next_frame + self.n_next) * self.hop)
            n = min((end - st.next_frame * self.hop) // self.hop, self.n_next) if last else self.n_next
        elif last:
            n = st.total // self.hop - st.next_frame  # NeMo's valid frame count is samples // hop
            end = st.total
        else:
            n = self._chunk_frames(st)
            end = (st.next_frame + n - 1) * self.hop + self._half_window()
        seg = st.buf[max(start, st.buf_start) - st.buf_start : end - st.buf_start]
        if start < st.buf_start:
            seg = np.concatenate([np.zeros(st.buf_start - start, np.float32), seg])
        # consume: keep audio from the next chunk's context start
        st.next_frame += n
        keep = max(st.next_frame * self.hop - ctx, 0)
        if keep > st.buf_start:
            st.buf = st.buf[keep - st.buf_start :]
            st.buf_start = keep
        return seg, n

    @torch.inference_mode()
    def _advance(self, streams: list[_Stream], last: list[bool]) -> None:
        """One chunk of each of ``streams`` through the model, all in one batch (``last[b]``: the
        stream's final, short chunk), in four stages."""
        idx = self._index([st.slot for st in streams])
        first = [st.next_frame == 0 and not self.nemo_framing for st in streams]
        mel, n_frames = self._chunk_features(streams, last)
        pre, pre_len = self._pre_encode_chunks(mel, n_frames, first, idx)
        enc_out, enc_len = self._encode(pre, pre_len, idx)
        self._decode(streams, enc_out, enc_len, idx)

    def _chunk_features(self, streams: list[_Stream], last: list[bool]) -> tuple[torch.Tensor, list[int]]:
        """Stage 1: each chunk's raw audio (consumed from its stream) to mel frames, in one
        preprocessor call. Returns the chunks' new frames [B, F, span] and each one's frame count."""
        segs, n_frames = zip(*(self._segment(st, ls) for st, ls in zip(streams, last)))
        seg_len = np.array([len(seg) for seg in segs])
        width = int(seg_len.max())
        if self.nemo_framing:  # NeMo zero-pads every frame to the full chunk
            width = (self._ctx + self.n_next) * self.hop
        audio = np.zeros((len(segs), width), np.float32)
        for b, seg in enumerate(segs):
            audio[b, : len(seg)] = seg
        x = torch.from_numpy(audio).to(self.device, torch.float32, non_blocking=True)  # features in float32, as NeMo
        x_len = torch.from_numpy(seg_len).to(self.device)
        feats = self._features(x, x_len, full=bool((seg_len == width).all()))
        span = max(max(n_frames), self.n_next)
        if feats.shape[-1] < self._ctx + span:
            feats = torch.nn.functional.pad(feats, (0, self._ctx + span - feats.shape[-1]))
        return feats[:, :, self._ctx : self._ctx + span], list(n_frames)

    def _pre_encode_chunks(
        self, mel: torch.Tensor, n_frames: list[int], first: list[bool], idx: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Stage 2: causal conv subsampling, masked by length, and the mel pre-encode cache shift.

        First chunks have no cache and drop nothing; later chunks run on [mel cache | chunk] and
        drop the extra frames. Both groups have fixed widths; last chunks ride along shorter (their
        padding is masked out). Returns [B, T, D] padded to a fixed T (static shapes for
        torch.compile), rows in the order of ``mel``, and their lengths."""
        B = mel.shape[0]
        n_t = torch.tensor(n_frames, dtype=torch.long, device=self.device)
        pre_parts, len_parts, order = [], [], []
        for is_first in (True, False):
            rows = [b for b in range(B) if first[b] == is_first]
            if not rows:
                continue
            r = self._index(rows)
            if is_first:
                x_g = mel.index_select(0, r)[:, :, : self.n_first]
                full = all(n_frames[b] >= self.n_first for b in rows)
                o, ol = self._pre_encode(x_g.transpose(1, 2), n_t.index_select(0, r), full)
                ol = ol.long()
            else:
                x_g = torch.cat(
                    [self.mel_cache.index_select(0, idx.index_select(0, r)), mel.index_select(0, r)[:, :, : self.n_next]],
                    dim=-1,
                )
                full = all(n_frames[b] >= self.n_next for b in rows)
                o, ol = self._pre_encode(x_g.transpose(1, 2), n_t.index_select(0, r) + self.pre_cache, full)
                o, ol = o[:, self.drop_extra :], (ol.long() - self.drop_extra).clamp(min=0)
            pre_parts.append(o)
            len_parts.append(ol)
            order += rows
        self._shift_mel_cache(mel, n_t, idx)
        T = max(self.out_len, max(p.shape[1] for p in pre_parts))
        pre = torch.cat([torch.nn.functional.pad(p, (0, 0, 0, T - p.shape[1])) for p in pre_parts], 0)
        pre_len = torch.cat(len_parts, 0)
        if order != list(range(B)):  # back to the order of `streams`
            inv = self._index([order.index(b) for b in range(B)])
            pre, pre_len = pre.index_select(0, inv), pre_len.index_select(0, inv)
        return pre, pre_len

    def _shift_mel_cache(self, mel: torch.Tensor, n_t: torch.Tensor, idx: torch.Tensor) -> None:
        """Keep the last ``pre_cache`` mel frames of [cache | this chunk]: one gather, one scatter."""
        tail_pos = n_t[:, None] + torch.arange(self.pre_cache, device=self.device)[None, :]
        both = torch.cat([self.mel_cache.index_select(0, idx), mel], dim=-1)
        self.mel_cache.index_copy_(0, idx, torch.gather(both, 2, tail_pos[:, None, :].expand(-1, both.shape[1], -1)))

    def _encode(self, pre: torch.Tensor, pre_len: torch.Tensor, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Stage 3: the encoder layers, one (compiled) call for the whole batch on the slots'
        gathered caches; the updated caches are scattered back."""
        enc_out, enc_len, caches, ch_len = self._layers(
            pre,
            pre_len,
            [cache.index_select(1, idx) for cache in self.caches],
            self.cache_len.index_select(0, idx),
            pos=self.enc_step.positions(pre.shape[1]),
        )
        for cache, new in zip(self.caches, caches):
            cache.index_copy_(1, idx, new)
        self.cache_len.index_copy_(0, idx, ch_len)
        return enc_out, enc_len

    def _decode(self, streams: list[_Stream], enc_out: torch.Tensor, enc_len: torch.Tensor, idx: torch.Tensor) -> None:
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
            self.g.index_select(0, idx),
            self.hc.index_select(1, idx),
        )
        self.g.index_copy_(0, idx, g)
        self.hc.index_copy_(1, idx, hc)
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

    def _events(self, st: _Stream) -> list[STTEvent]:
        events = []
        if st.tokens:
            text = self.tokenizer.ids_to_text(st.tokens)
            if text != st.text:
                delta = text[len(st.text) :] if text.startswith(st.text) else text
                st.text = text
                if delta:
                    events.append(STTEvent(st.id, "partial", delta))
        ep = self.cfg.endpoint_ms
        if ep is not None and st.tokens and not st.endpointed:
            if (st.enc_frames - 1 - st.last_token_frame) * self.frame_ms >= ep:
                st.endpointed = True
                events.append(STTEvent(st.id, "endpoint", ""))
        return events
