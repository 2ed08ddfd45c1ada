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

The parts: :class:`~pipeline.tts.stream.TTSStream` (one utterance, as its consumer reads it),
:class:`~pipeline.tts.voices.Voices`, :class:`~pipeline.tts.clip_encoder.ClipEncoder` (Mimi
encode of clips in fixed shapes), ``pipeline/tts/compiled.py`` (the gated, compiled or graphed
functions) and ``pipeline/tts/warmup.py``; this module is admission and the step scheduler.
"""
from __future__ import annotations

import functools
import logging
import math
import time
from collections import deque

import numpy as np
import torch

from pipeline.audio_constants import REPLY_RATE
from pipeline.engines import EngineBusy
from pipeline.tts.clip_encoder import ClipEncoder, mimi_encode, mimi_encode_piece
from pipeline.tts.compiled import gated_functions
from pipeline.tts.config import TTSConfig
from pipeline.tts.csm import CSM, load_csm, tiny_arch
from pipeline.tts.mimi import SlotDecoder, load_mimi, to_int16
from pipeline.tts.prompt import PromptBuilder, Segment
from pipeline.tts.stream import StreamRows, TTSStream
from pipeline.tts.voices import VoiceProfile, Voices
from pipeline.tts.sampling import race_noise, race_width
from pipeline.tts.warmup import warm

__all__ = ["TTSEngine", "TTSStream", "TTSBusyError", "Segment", "VoiceProfile"]

log = logging.getLogger(__name__)


class TTSBusyError(EngineBusy):
    """Every slot is taken and the waiting line is full (through Ray, the gateway's error is an
    instance of it too, so the session tells its client ``server_busy``)."""


class TTSEngine(StreamRows):
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
        encode_buckets = tuple(sorted({int(b) for b in cfg.encode_buckets}))
        if not encode_buckets or encode_buckets[0] < 1:
            raise ValueError(f"encode_buckets must be positive frame counts, got {cfg.encode_buckets!r}")
        self.decoder = SlotDecoder(self.mimi, self.num_slots)
        self.voices = Voices(cfg)  # their clips are encoded at warm-up, on the serving thread, in warmed shapes
        self._init_rows()
        self._set_process_flags()
        shapes = max(len(self.prefill_buckets), len(encode_buckets), len(self.batch_widths))
        self.fns = gated_functions(cfg, self.device, shapes, {
            "frame": (self._frame_fn, True, True),
            "prefill": (self.csm.prefill_at, True, True),
            "encode": (functools.partial(mimi_encode, self.mimi), False, True),
            # Mimi's streaming state holds Python ints (offsets): eager, in fixed-size pieces
            "encode_piece": (functools.partial(mimi_encode_piece, self.mimi), True, False),
            "decode": (self.decoder.decode, True, False),
        })
        self.encoder = ClipEncoder(self.mimi, self.fns["encode"], self.fns["encode_piece"], encode_buckets,
                                   self.num_codebooks, self.device)
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

    # -- streams (their rows and queue: StreamRows) -------------------------------------------------
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
        codes = self.generate(width)
        pcm = self.decode(codes, width)
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

    def generate(self, width: int) -> torch.Tensor:
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

    def decode(self, codes: torch.Tensor, width: int) -> torch.Tensor:
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

    def warmup(self) -> None:
        """Every shape of the serving path, run on this (the serving) thread (``pipeline/tts/warmup.py``)."""
        warm(self)
