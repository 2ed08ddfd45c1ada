"""Streaming TTS for many streams at once: CSM generates Mimi frames in one batched step,
Mimi decodes them in streaming mode to int16 PCM.

Continuous batching. The engine has ``num_slots`` slots; a slot is a row of CSM's static KV caches
(backbone and depth decoder) and a row of Mimi's streaming decode state. A new stream waits
(FIFO) for a free slot, takes the lowest one, and its prompt is prefilled into that row alone
(one prefill per :meth:`TTSEngine.step`, so a joining stream holds the others up by one prefill
at most). Every step then advances every stream with a slot by exactly one 80 ms frame: one
frame step over cache rows ``0..W-1`` (``W`` the smallest batch width covering the busy rows;
each row at its own position, with its own seed and temperature) and one Mimi decode over all
rows, where moshi's exec mask leaves the rows without a new frame untouched. A stream that ends
(an all-zero frame, or its frame budget) or is cancelled frees its slot at once, before the
next step. Per step the host reads the new codes and PCM once.

Threading: every engine call (``stream``, ``step``, ``cancel``, ``encode*``) runs on the one
inference thread of the replica. ``TTSStream.take`` alone may run elsewhere (the service's
event loop): it only pops published chunks off a deque.

Batch invariance: at a given batch width, a stream's codes do not depend on which rows step
beside it or when it joined: its row attends only to its own cache row, and its sampling noise is
a function of its own seed and frame counter (:func:`pipeline.tts.sampling.race_noise`). Across
widths the matmul kernels differ (a 1-row GEMV vs a GEMM), so logits can differ by float
rounding (~1e-7), which flips a sampled token that sits on a near-tie now and then; greedy codes
stay equal. ``batch_widths=(num_slots,)`` (one width) makes sampled codes exactly invariant, at
the cost of a full-width step when few streams run (cheap on a GPU, where the step is
memory-bound; ~1.7x the 1-stream cost on the tiny CPU profile).

No stall at a turn boundary, by construction (docs/stall.md): every tensor function on the
serving path has a closed set of input shapes (the frame step: one per batch width; the prompt
prefill: one per prompt bucket; Mimi encode of user audio: one per encode bucket plus one
streaming piece; the decode: one), ``warmup()`` runs each of them on the serving thread, and a
:class:`~pipeline.tts.shape_gate.ShapeGate` keeps any shape warm-up did not see away from
torch.compile. Bot turns reuse the codes they were generated from; audio is never re-encoded.
"""
from __future__ import annotations

import logging
import math
import time
from collections import deque
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from pipeline.audio_constants import CODEC_FRAME_SAMPLES, REPLY_RATE, USER_RATE
from pipeline.engines import EngineBusy
from pipeline.tts.config import TTSConfig
from pipeline.tts.csm import CSM, load_csm, tiny_arch
from pipeline.tts.cuda_graphs import GraphedFunction
from pipeline.tts.mimi import SlotDecoder, encode_streaming_modules, load_mimi, to_int16
from pipeline.tts.prompt import BOT_SPEAKER, PromptBuilder, Segment
from pipeline.tts.sampling import race_noise, race_width
from pipeline.tts.shape_gate import ShapeGate

__all__ = ["TTSEngine", "TTSStream", "TTSBusyError", "Segment"]

log = logging.getLogger(__name__)


class TTSBusyError(EngineBusy):
    """Every slot is taken and the waiting line is full (through Ray, the gateway's error is an
    instance of it too, so the session tells its client ``server_busy``)."""


@dataclass(frozen=True)
class VoiceProfile:
    """A voice as the engine speaks it: the CSM speaker id of its text and turns, and the reference
    clip (codes and transcript) that leads its prompts."""

    speaker: int
    reference: Segment | None = None


class TTSStream:
    """One utterance: int16 mono 24 kHz chunks with the Mimi codes that made them.

    The first chunk covers ``first_chunk_frames`` frames, each later one ``chunk_frames`` (the last
    may be shorter). Iterating steps the engine until this stream has a chunk (other streams
    advance too); a server instead steps the engine in a loop and calls :meth:`take`.
    ``.codes`` ([frames, 32] int64) and ``.frames`` hold the frames whose audio has been taken so
    far (all of them once the iteration ends). ``close()`` ends it early and frees its slot.
    """

    def __init__(self, engine: "TTSEngine", tokens: np.ndarray, mask: np.ndarray, max_frames: int,
                 seed: int, temperature: float):
        self._engine = engine
        self.prompt_tokens, self.prompt_mask = tokens, mask
        self.max_frames, self.seed, self.temperature = max_frames, seed, temperature
        self.row: int | None = None  # the slot, while the stream holds one
        self.generated = 0  # frames generated so far
        self.finished = False  # no chunk will be published any more
        self.closed = False  # cancelled by the consumer
        self.timings: dict[str, float] = {}
        self._opened_at = time.perf_counter()
        self._ready: deque[tuple[np.ndarray, np.ndarray]] = deque()  # published, not yet taken
        self._pcm: list[np.ndarray] = []  # frames since the last published chunk
        self._frame_codes: list[np.ndarray] = []
        self._published = 0
        self._taken: list[np.ndarray] = []

    # -- consumer side ------------------------------------------------------------------------------
    def take(self) -> tuple[np.ndarray, np.ndarray] | None:
        """The next published chunk and its codes ([n, 32]), or None if none is ready."""
        try:
            pcm, codes = self._ready.popleft()
        except IndexError:
            return None
        self._taken.append(codes)
        return pcm, codes

    def __iter__(self) -> "TTSStream":
        return self

    def __next__(self) -> np.ndarray:
        while True:
            item = self.take()
            if item is not None:
                return item[0]
            if self.finished:
                raise StopIteration
            self._engine.step()

    @property
    def codes(self) -> np.ndarray:
        if not self._taken:
            return np.zeros((0, self._engine.num_codebooks), dtype=np.int64)
        return np.concatenate(self._taken)

    @property
    def frames(self) -> int:
        return sum(len(c) for c in self._taken)

    def close(self) -> None:
        """Stop generating and free the slot (idempotent; on the inference thread)."""
        self._engine.cancel(self)

    # -- engine side (inference thread) ----------------------------------------------------------------
    def _add_frame(self, codes: np.ndarray, pcm: np.ndarray) -> None:
        cfg = self._engine.cfg
        self._frame_codes.append(codes)
        self._pcm.append(pcm)
        self.generated += 1
        if len(self._pcm) >= (cfg.first_chunk_frames if self._published == 0 else cfg.chunk_frames):
            self._publish()

    def _publish(self) -> None:
        if not self._pcm:
            return
        self._ready.append((np.concatenate(self._pcm), np.stack(self._frame_codes).astype(np.int64)))
        self._pcm, self._frame_codes = [], []
        self._published += 1
        self.timings.setdefault("first_chunk_s", time.perf_counter() - self._opened_at)


class TTSEngine:
    """CSM + Mimi serving ``cfg.num_slots`` streams in one batched frame step (module docstring)."""

    sample_rate = REPLY_RATE

    def __init__(self, cfg: TTSConfig | None = None):
        self.cfg = cfg = cfg or TTSConfig.tiny()
        self.device = torch.device(cfg.device)
        self.csm = self._load_csm()
        self.csm.eval().requires_grad_(False)
        self.num_slots = cfg.num_slots
        if self.num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {self.num_slots}")
        self.csm.setup_caches(cfg.max_seq_len, rows=self.num_slots)
        self.mimi = load_mimi(cfg.profile, cfg.mimi, device=cfg.device, seed=cfg.seed)
        self.mimi.requires_grad_(False)
        self.num_codebooks = self.csm.arch.num_codebooks
        self.csm.n_valid = min(self.csm.arch.audio_vocab, self.mimi.cardinality)
        self.prompts = PromptBuilder(self.tokenizer, self.num_codebooks)
        self.prefill_buckets = self._prefill_buckets()
        self.batch_widths = self._batch_widths()
        self.encode_buckets = tuple(sorted({int(b) for b in cfg.encode_buckets}))
        if not self.encode_buckets or self.encode_buckets[0] < 1:
            raise ValueError(f"encode_buckets must be positive frame counts, got {cfg.encode_buckets!r}")
        self.decoder = SlotDecoder(self.mimi, self.num_slots)
        # Named voices; their clips are encoded in warmup(), on the serving thread, in warmed shapes.
        self.voices = {name: VoiceProfile(spec.get("speaker", 0)) for name, spec in cfg.voice_specs().items()}
        self.voice_aliases = cfg.aliases()
        self._init_rows()
        self._set_process_flags()
        self._build_static_fns()
        self.warm = False

    def _load_csm(self) -> CSM:
        cfg = self.cfg
        dtype = getattr(torch, cfg.dtype)
        if cfg.profile == "tiny":
            from pipeline.runtime.tokenizer import tiny_tokenizer

            self.tokenizer = tiny_tokenizer()
            return CSM(tiny_arch(len(self.tokenizer))).init_random(cfg.seed).to(device=self.device, dtype=dtype)
        if cfg.profile == "full":  # CSM-1B's architecture with random weights (benchmarks, no download)
            from transformers import CsmConfig

            from pipeline.runtime.tokenizer import tiny_tokenizer
            from pipeline.tts.csm import arch_from_hf_config

            self.tokenizer = tiny_tokenizer()
            with torch.device(self.device):
                csm = CSM(arch_from_hf_config(CsmConfig())).init_random(cfg.seed)
            return csm.to(dtype=dtype)
        if cfg.profile == "real":
            from pipeline.runtime.tokenizer import load_tokenizer

            self.tokenizer = load_tokenizer(cfg.tokenizer or cfg.csm)
            return load_csm(cfg.csm, device=cfg.device, dtype=dtype)
        raise ValueError(f"unknown TTS profile {cfg.profile!r}")

    def _init_rows(self) -> None:
        """Per-slot generation state on the device ([num_slots, ...]) and the slot table on the host."""
        S, K, dev = self.num_slots, self.num_codebooks, self.device
        self.row_h = torch.zeros(S, self.csm.arch.backbone.dim, dtype=getattr(torch, self.cfg.dtype), device=dev)
        self.row_first = torch.zeros(S, dtype=torch.bool, device=dev)  # next frame is the utterance's first
        self.row_codes = torch.zeros(S, K, dtype=torch.long, device=dev)  # the previous frame
        self.row_pos = torch.zeros(S, dtype=torch.long, device=dev)  # where the previous frame goes
        self.row_active = torch.zeros(S, dtype=torch.bool, device=dev)
        self.row_seed = torch.zeros(S, dtype=torch.long, device=dev)
        self.row_frame = torch.zeros(S, dtype=torch.long, device=dev)  # frames generated: the noise counter
        self.row_temp = torch.zeros(S, dtype=torch.float32, device=dev)
        self._decode_in = torch.zeros(S, K, 1, dtype=torch.long, device=dev)
        self._audible = torch.zeros(S, dtype=torch.bool, device=dev)
        self._rows: list[TTSStream | None] = [None] * S
        self._waiting: deque[TTSStream] = deque()
        self._next_seed = self.cfg.seed

    # -- static shapes ----------------------------------------------------------------------------
    def _prefill_buckets(self) -> tuple[int, ...]:
        top = self.cfg.max_seq_len
        if self.cfg.prefill_buckets:
            found = {min(int(b), top) for b in self.cfg.prefill_buckets if int(b) > 0}
        else:
            found, b = set(), 64
            while b < top:
                found.add(b)
                b *= 2
        found.add(top)  # any prompt fits the KV cache, so it fits the largest bucket
        return tuple(sorted(found))

    def _batch_widths(self) -> tuple[int, ...]:
        S = self.num_slots
        if self.cfg.batch_widths:
            found = {min(int(w), S) for w in self.cfg.batch_widths if int(w) > 0}
        else:
            found, w = set(), 1
            while w < S:
                found.add(w)
                w *= 2
        found.add(S)  # every busy row fits the full width
        return tuple(sorted(found))

    def width_for(self, rows: int) -> int:
        """The batch width of a step whose highest busy row is ``rows - 1``."""
        return next(w for w in self.batch_widths if rows <= w)

    def _set_process_flags(self) -> None:
        """cuDNN autotuning off (unless configured): a new conv input length would start an
        algorithm search of seconds, cached per thread (docs/stall.md)."""
        if self.device.type == "cuda" or torch.cuda.is_available():
            torch.backends.cudnn.benchmark = bool(self.cfg.cudnn_benchmark)

    def _build_static_fns(self) -> None:
        cfg = self.cfg
        mode = cfg.compile_mode
        if mode is None and self.device.type == "cuda":
            mode = "reduce-overhead"  # CUDA graphs: static inputs are the step buffers and caches
        before = None
        if cfg.compile and mode == "reduce-overhead":
            before = torch.compiler.cudagraph_mark_step_begin
        if cfg.compile:  # one cache entry per bucket / width: make sure dynamo keeps them all
            need = max(len(self.prefill_buckets), len(self.encode_buckets), len(self.batch_widths)) + 2
            for name in ("recompile_limit", "cache_size_limit"):
                if hasattr(torch._dynamo.config, name) and getattr(torch._dynamo.config, name) < need:
                    setattr(torch._dynamo.config, name, need)

        def compiled(name, fn, fullgraph: bool):
            if cfg.frame_graphs and name == "frame":  # captured, not compiled
                return GraphedFunction(fn)
            if not cfg.compile or name not in cfg.compile_fns:
                return None
            kw: dict = dict(dynamic=False, fullgraph=fullgraph, backend=cfg.compile_backend)
            if mode and cfg.compile_backend == "inductor":
                kw["mode"] = mode
            return torch.compile(fn, **kw)

        def fn(name, f, fullgraph=True, compile_it=True):
            return ShapeGate(name, f, compiled(name, f, fullgraph) if compile_it else None, cfg.slow_step_ms, before)

        self.fns: dict[str, ShapeGate] = {
            "frame": fn("frame", self._frame_fn),
            "prefill": fn("prefill", self.csm.prefill_at),
            "encode": fn("encode", self._mimi_encode, fullgraph=False),
            # Mimi's streaming state holds Python ints (offsets): eager, in fixed-size pieces
            "encode_piece": fn("encode_piece", self._mimi_encode_piece, compile_it=False),
            "decode": fn("decode", self.decoder.decode, compile_it=False),
        }

    def _frame_fn(self, h0, first, prev_codes, pos, noise, temperature) -> torch.Tensor:
        return self.csm.frame_fn(h0, first, prev_codes, pos, noise, temperature, self.cfg.top_k)

    def stats(self) -> dict[str, int]:
        """Calls of the gated functions whose shapes warm-up did not cover, and slow calls."""
        return {"unseen_shape_calls": sum(f.unseen_calls for f in self.fns.values()),
                "slow_calls": sum(f.slow_calls for f in self.fns.values())}

    def bucket_for(self, rows: int) -> int:
        for b in self.prefill_buckets:
            if rows <= b:
                return b
        raise ValueError(f"prompt of {rows} rows beyond the KV cache ({self.cfg.max_seq_len})")

    @torch.inference_mode()
    def prefill(self, tokens: np.ndarray, mask: np.ndarray, row: int = 0) -> torch.Tensor:
        """Prompt rows ([L, 33]) padded at the end to their bucket, into cache row ``row`` -> the last
        real row's hidden state [1, D]."""
        rows = len(tokens)
        b = self.bucket_for(rows)
        tok = np.zeros((b, tokens.shape[1]), dtype=np.int64)
        msk = np.zeros((b, tokens.shape[1]), dtype=bool)
        tok[:rows], msk[:rows] = tokens, mask
        dev = self.device
        last = torch.tensor([rows - 1], dtype=torch.long, device=dev)
        slot = torch.tensor([row], dtype=torch.long, device=dev)
        h = self.fns["prefill"](torch.from_numpy(tok).to(dev)[None], torch.from_numpy(msk).to(dev)[None], last, slot)
        return h.clone() if self.device.type == "cuda" else h  # CUDA-graph outputs are reused

    # -- streams ----------------------------------------------------------------------------------
    @property
    def active_requests(self) -> int:
        """Streams opened and not yet finished or closed (with a slot, or waiting for one)."""
        return sum(s is not None for s in self._rows) + len(self._waiting)

    def has_work(self) -> bool:
        return bool(self._waiting) or any(s is not None for s in self._rows)

    def max_frames_for(self, text: str) -> int:
        """Frame budget of an utterance: ``frames_per_word`` per word (at least ``min_frames``), at
        most ``max_frames``. A trained CSM stops earlier on its own (all-zero frame); this bound is
        what ends speech for the random-weight tiny model, which rarely emits that frame."""
        words = max(1, len(text.split()))
        return max(1, min(self.cfg.max_frames, max(self.cfg.min_frames, math.ceil(self.cfg.frames_per_word * words))))

    def build_prompt(self, text: str, context: list[Segment] | None = None, speaker: int | None = None,
                     max_frames: int | None = None, reference: Segment | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Prompt rows ([L, 33] tokens and mask) leaving room for ``max_frames`` generated frames."""
        max_frames = self.max_frames_for(text) if max_frames is None else max_frames
        speaker = self.cfg.speaker if speaker is None else speaker
        budget = self.cfg.max_seq_len - max_frames  # the context budget: oldest segments are dropped
        if self.cfg.max_prompt_rows is not None:
            budget = min(budget, self.cfg.max_prompt_rows)
        return self.prompts.build(speaker, text, context, budget, reference)

    def voice(self, name: str = "default", reference: Segment | None = None) -> VoiceProfile:
        """The voice ``name`` (or an alias of one), with the session's own ``reference`` clip in place
        of its configured one when given; raises KeyError for a name this engine does not have."""
        profile = self.voices[self.voice_aliases.get(name, name)]
        reference = profile.reference if reference is None else reference
        if reference is not None and reference.speaker != profile.speaker:
            reference = Segment(profile.speaker, reference.text, reference.codes)
        return VoiceProfile(profile.speaker, reference)

    def voice_context(self, profile: VoiceProfile, context: list[Segment] | None) -> list[Segment]:
        """A session's context as ``profile`` speaks it: the bot's turns carry the voice's speaker id."""
        if profile.speaker == BOT_SPEAKER:
            return list(context or [])
        return [Segment(profile.speaker, s.text, s.codes) if s.speaker == BOT_SPEAKER else s for s in context or []]

    def stream(self, text: str, context: list[Segment] | None = None, speaker: int | None = None,
               max_frames: int | None = None, seed: int | None = None,
               temperature: float | None = None, reference: Segment | None = None) -> TTSStream:
        """Queue a stream for ``text`` (after ``reference``, the voice's clip, and ``context``); it
        takes a slot at a later :meth:`step`. ``seed`` fixes its sampling (default: the engine's next
        seed); raises :class:`TTSBusyError` if too many wait."""
        if len(self._waiting) >= self.cfg.max_waiting:
            raise TTSBusyError(f"all {self.num_slots} TTS slots are busy and {len(self._waiting)} streams wait")
        max_frames = self.max_frames_for(text) if max_frames is None else min(max_frames, self.cfg.max_frames)
        tokens, mask = self.build_prompt(text, context, speaker, max_frames, reference)
        if seed is None:
            seed, self._next_seed = self._next_seed, self._next_seed + 1
        temperature = self.cfg.temperature if temperature is None else float(temperature)
        s = TTSStream(self, tokens, mask, max_frames, int(seed), temperature)
        self._waiting.append(s)
        return s

    def cancel(self, s: TTSStream) -> None:
        """End ``s`` now: it leaves the waiting line or frees its slot before the next step."""
        if s.closed:
            return
        s.closed = s.finished = True
        if s.row is not None:
            self._release(s)
        else:
            try:
                self._waiting.remove(s)
            except ValueError:
                pass

    # -- the batched step ---------------------------------------------------------------------------
    @torch.inference_mode()
    def step(self) -> list[TTSStream]:
        """Let one waiting stream take a free slot (its prefill), then generate one frame for every
        stream with a slot. Returns the streams that advanced (they may have new chunks, or ended)."""
        self._admit()
        live = [(r, s) for r, s in enumerate(self._rows) if s is not None]
        if not live:
            return []
        width = self.width_for(live[-1][0] + 1)
        codes = self._generate(width)
        pcm = self._decode(codes, width)
        host_codes, host_pcm = codes.cpu().numpy(), to_int16(pcm)  # the host's one read per step
        for r, s in live:
            if not host_codes[r].any():  # CSM's end of speech: an all-zero frame
                self._finish(s)
                continue
            s._add_frame(host_codes[r].copy(), host_pcm[r])
            if s.generated >= s.max_frames:
                self._finish(s)
        return [s for _, s in live]

    def _admit(self) -> None:
        if not self._waiting or all(s is not None for s in self._rows):
            return
        s = self._waiting.popleft()
        r = self._rows.index(None)  # the lowest free row keeps the busy rows (and widths) low
        t0 = time.perf_counter()
        h = self.prefill(s.prompt_tokens, s.prompt_mask, r)
        self.row_h[r] = h[0]
        self.row_first[r] = True
        self.row_pos[r] = len(s.prompt_tokens)
        self.row_frame[r] = 0
        self.row_seed[r] = s.seed
        self.row_temp[r] = s.temperature
        self.row_active[r] = True
        reset = torch.zeros(self.num_slots, dtype=torch.bool, device=self.device)
        reset[r] = True
        self.decoder.reset(reset)
        self._rows[r], s.row = s, r
        s.timings["prefill_s"] = time.perf_counter() - t0

    def _generate(self, width: int) -> torch.Tensor:
        """One frame for cache rows 0..width-1 -> codes [width, K]; advances the busy rows' state.
        Noise is drawn for every row (greedy rows ignore it): one graph per width."""
        width_k = race_width(self.cfg.top_k, self.csm.n_valid)
        noise = race_noise(self.row_seed[:width], self.row_frame[:width], self.num_codebooks, width_k)
        codes = self.fns["frame"](self.row_h[:width], self.row_first[:width], self.row_codes[:width],
                                  self.row_pos[:width], noise, self.row_temp[:width])
        active = self.row_active[:width]
        self.row_pos[:width] += (active & ~self.row_first[:width]).long()
        self.row_first[:width] &= ~active
        self.row_frame[:width] += active.long()
        self.row_codes[:width] = codes
        return codes

    def _decode(self, codes: torch.Tensor, width: int) -> torch.Tensor:
        """Mimi decode of this step's frame for every slot -> [num_slots, 1920]; only busy rows with a
        speech frame advance their decoder state (exec mask)."""
        self._decode_in[:width, :, 0] = codes
        self._audible.copy_(self.row_active)
        self._audible[:width] &= codes.any(dim=-1)
        return self.fns["decode"](self._decode_in, self._audible)

    def _finish(self, s: TTSStream) -> None:
        s._publish()
        s.finished = True
        self._release(s)

    def _release(self, s: TTSStream) -> None:
        r = s.row
        if r is None:
            return
        self.row_active[r] = False
        self._rows[r], s.row = None, None

    # -- Mimi encode of user audio: fixed bucket lengths ---------------------------------------------
    def _mimi_encode(self, wav: torch.Tensor) -> torch.Tensor:
        return self.mimi.encode(wav)

    def _mimi_encode_piece(self, wav: torch.Tensor) -> torch.Tensor:
        """One piece of a streaming encode (the encode path's modules are in streaming mode)."""
        mimi = self.mimi
        emb = mimi.encoder(wav)
        if mimi.encoder_transformer is not None:
            (emb,) = mimi.encoder_transformer(emb)
        return mimi.quantizer.encode(mimi._to_framerate(emb))

    @torch.inference_mode()
    def encode_wave(self, wav: np.ndarray) -> np.ndarray:
        """Float mono 24 kHz audio -> Mimi codes [T, 32] int64, T = ceil(len / 1920).

        Up to the largest bucket: padded at the end to the next bucket and encoded in one call
        (Mimi is causal, so the valid frames' codes equal an unpadded encode). Longer: Mimi's
        streaming encode over pieces of exactly the largest bucket (the last one padded), whose
        codes equal a one-shot encode of the whole. Either way only warmed shapes run."""
        wav = np.asarray(wav, dtype=np.float32).reshape(-1)
        n = len(wav)
        k = self.num_codebooks
        if n == 0:
            return np.zeros((0, k), dtype=np.int64)
        frames = -(-n // CODEC_FRAME_SAMPLES)
        top = self.encode_buckets[-1]
        if frames <= top:
            b = next(b for b in self.encode_buckets if frames <= b)
            x = np.zeros(b * CODEC_FRAME_SAMPLES, dtype=np.float32)
            x[:n] = wav
            codes = self.fns["encode"](torch.from_numpy(x).to(self.device).view(1, 1, -1))[0, :, :frames]
        else:
            piece = top * CODEC_FRAME_SAMPLES
            x = np.zeros(-(-n // piece) * piece, dtype=np.float32)
            x[:n] = wav
            xt = torch.from_numpy(x).to(self.device).view(1, 1, -1)
            with ExitStack() as stack:
                for m in encode_streaming_modules(self.mimi):
                    stack.enter_context(m.streaming(1))
                parts = [self.fns["encode_piece"](xt[..., a : a + piece]) for a in range(0, len(x), piece)]
            codes = torch.cat(parts, dim=-1)[0, :, :frames]
        return codes.T.cpu().numpy().astype(np.int64)

    def encode(self, pcm_24k: np.ndarray) -> np.ndarray:
        """User audio (int16 or float in [-1, 1], mono 24 kHz) -> Mimi codes [T, 32] int64."""
        x = np.asarray(pcm_24k)
        x = x.astype(np.float32) / 32768.0 if x.dtype == np.int16 else x.astype(np.float32)
        return self.encode_wave(x)

    def encode_user_audio(self, pcm_16k: np.ndarray) -> np.ndarray:
        """A user turn as the gateway carries it (int16 mono 16 kHz) -> Mimi codes [T, 32] int64:
        resampled to 24 kHz once, then :meth:`encode_wave` (bucketed, never a new shape). Encode
        each user turn once and keep its codes in its :class:`Segment`."""
        return self.encode_audio(pcm_16k, USER_RATE)

    def encode_audio(self, pcm: np.ndarray, rate: int) -> np.ndarray:
        """int16 mono audio at ``rate`` -> Mimi codes [T, 32]: resampled to 24 kHz, then :meth:`encode_wave`."""
        from pipeline.audio import int16_to_float, resample

        return self.encode_wave(resample(int16_to_float(np.asarray(pcm, dtype=np.int16)), rate, REPLY_RATE))

    def _encode_voices(self) -> None:
        """Each configured voice's clip, encoded once (warmed buckets) and kept as its reference."""
        from pipeline.audio import read_wav

        root = Path(__file__).resolve().parents[2]
        for name, spec in self.cfg.voice_specs().items():
            if spec.get("clip") is None:
                continue
            path = Path(spec["clip"])
            pcm, rate = read_wav(str(path if path.is_absolute() else root / path))
            codes = self.encode_audio(pcm, rate)
            self.voices[name] = VoiceProfile(self.voices[name].speaker,
                                             Segment(self.voices[name].speaker, spec["text"].strip(), codes))
            log.info("voice %s: %.1f s clip -> %d frames", name, len(pcm) / rate, len(codes))

    # -- warm-up ----------------------------------------------------------------------------------
    @torch.inference_mode()
    def _run_every_shape(self) -> None:
        cfg, k = self.cfg, self.num_codebooks
        for b in self.encode_buckets:  # each encode bucket, then the streaming path (2 pieces)
            self.encode_wave(np.zeros(b * CODEC_FRAME_SAMPLES, dtype=np.float32))
        self.encode_wave(np.zeros(self.encode_buckets[-1] * CODEC_FRAME_SAMPLES + 1, dtype=np.float32))
        self.encode_user_audio(np.zeros(USER_RATE // 10, dtype=np.int16))  # and the user path (resample)
        for b in self.prefill_buckets:  # each prefill bucket (into the last row: it is free now)
            tokens = np.zeros((b, k + 1), dtype=np.int64)
            mask = np.zeros((b, k + 1), dtype=bool)
            mask[:, k] = True
            self.prefill(tokens, mask, self.num_slots - 1)
        for width in self.batch_widths:  # the frame step at every width
            self._generate(width)
        self._decode(self.row_codes[: self.batch_widths[-1]], self.batch_widths[-1])
        self.decoder.reset(torch.ones(self.num_slots, dtype=torch.bool, device=self.device))
        streams = [self.stream("Hello there.", max_frames=cfg.first_chunk_frames + cfg.chunk_frames)
                   for _ in range(min(2, self.num_slots))]
        for s in streams:  # and the whole path once, as requests run it (two streams joining)
            for _ in s:
                pass

    def warmup(self) -> None:
        """Run every shape of the serving path on THIS thread (call it on the serving thread: some
        caches are per thread). With ``compile``: an eager pass first (Mimi's quantizer builds its
        tables on first use, so a compile before it would be traced twice), then the compiled pass.
        Then the gates are sealed and torch's compiler stance set to ``cfg.stance_after_warmup``."""
        passes = (True, False) if self.cfg.compile or self.cfg.frame_graphs else (True,)
        t0 = time.perf_counter()
        try:  # under torch's default stance: one left by another engine of this process could skip compiles
            with torch.compiler.set_stance("default"):
                for eager in passes:
                    for f in self.fns.values():
                        f.force_eager = eager
                    self._run_every_shape()
        finally:
            for f in self.fns.values():
                f.force_eager = False
        for f in self.fns.values():
            f.seal()
        self._encode_voices()  # after the gates are sealed: a clip that needed a new shape would count
        self.warm = True
        if self.cfg.compile and self.cfg.stance_after_warmup != "default":
            torch.compiler.set_stance(self.cfg.stance_after_warmup)
        log.info("TTS warm in %.1f s: %d slots, batch widths %s, prefill buckets %s, encode buckets %s frames, "
                 "compile=%s", time.perf_counter() - t0, self.num_slots, self.batch_widths, self.prefill_buckets,
                 self.encode_buckets, self.cfg.compile)
