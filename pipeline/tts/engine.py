"""Streaming TTS: CSM generates Mimi frames, Mimi decodes them in streaming mode to int16 PCM.

Threading and concurrency: one engine serves ONE stream at a time, driven chunk by chunk from a
single inference thread (the caller calls ``next()`` on the stream from that thread). CSM's static
KV caches and Mimi's streaming decoder state live in the modules, so two interleaved streams would
corrupt each other; the Ray deployment serializes streams per replica. Opening a new stream while
another is still open closes the old one first (it then ends), which keeps ``active_requests`` at
most 1 and always leaves the modules in a clean state.

Per frame the hot loop runs one backbone position and 31 depth-decoder steps with fixed shapes and
on-device sampling; the host sees the codes once per audio chunk (to find the end of speech, an
all-zero frame) and the chunk's PCM.

No stall at a turn boundary, by construction (docs/stall.md): every tensor function on the serving
path has a closed set of input shapes (the per-frame step: one; the prompt prefill: one per prompt
bucket; Mimi encode of user audio: one per encode bucket plus one streaming piece; the streaming
decode: one per chunk size), ``warmup()`` runs each of them on the serving thread, and a
:class:`~pipeline.tts.static.StaticFn` gate keeps any shape warm-up did not see away from
torch.compile. Bot turns reuse the codes they were generated from; audio is never re-encoded.
"""
from __future__ import annotations

import logging
import math
import threading
import time
from contextlib import ExitStack

import numpy as np
import torch

from pipeline.tts.config import TTSConfig
from pipeline.tts.csm import CSM, load_csm, tiny_arch
from pipeline.tts.mimi import (FRAME_SIZE, SAMPLE_RATE, StreamingDecoder, encode_streaming_modules, load_mimi,
                               to_int16)
from pipeline.tts.prompt import PromptBuilder, Segment
from pipeline.tts.static import StaticFn

__all__ = ["TTSEngine", "TTSStream", "Segment"]

log = logging.getLogger(__name__)
USER_RATE = 16_000  # what the gateway and STT carry


class TTSStream:
    """Iterator of int16 mono 24 kHz chunks for one utterance.

    The first chunk covers ``first_chunk_frames`` frames, each later one ``chunk_frames`` (the last
    may be shorter). ``.codes`` ([frames, 32] int64) and ``.frames`` hold the frames whose audio has
    been yielded so far (all of them once the iteration ends). ``close()`` ends it early.
    """

    def __init__(self, engine: "TTSEngine", tokens: np.ndarray, mask: np.ndarray, max_frames: int):
        self._engine = engine
        self.prompt_tokens, self.prompt_mask = tokens, mask
        self.max_frames = max_frames
        self._codes: list[np.ndarray] = []
        self._generated = 0  # frames sampled on the device
        self._h: torch.Tensor | None = None
        self._buf: torch.Tensor | None = None
        self._decoder: StreamingDecoder | None = None
        self._started = False
        self._done = False
        self._closed = False
        self.timings: dict[str, float] = {}

    # -- public -----------------------------------------------------------------------------------
    def __iter__(self) -> "TTSStream":
        return self

    def __next__(self) -> np.ndarray:
        if self._done:
            raise StopIteration
        try:
            chunk = self._next_chunk()
        except BaseException:
            self.close()
            raise
        if chunk is None:
            self.close()
            raise StopIteration
        return chunk

    @property
    def codes(self) -> np.ndarray:
        if not self._codes:
            return np.zeros((0, self._engine.num_codebooks), dtype=np.int64)
        return np.concatenate(self._codes)

    @property
    def frames(self) -> int:
        return sum(len(c) for c in self._codes)

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Release the decoder state and the engine slot (idempotent)."""
        if self._closed:
            return
        self._closed = self._done = True
        try:
            if self._decoder is not None:
                self._decoder.close()
                self._decoder = None
        finally:
            self._h = self._buf = None
            self._engine._release(self)

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass

    # -- generation --------------------------------------------------------------------------------
    @torch.inference_mode()
    def _start(self) -> None:
        eng = self._engine
        t0 = time.perf_counter()
        dev = eng.device
        self._h = eng.prefill(self.prompt_tokens, self.prompt_mask)
        self._buf = torch.zeros(self.max_frames, eng.num_codebooks, dtype=torch.long, device=dev)
        self._decoder = StreamingDecoder(eng.mimi)
        self._started = True
        self.timings["prefill_s"] = time.perf_counter() - t0

    @torch.inference_mode()
    def _next_chunk(self) -> np.ndarray | None:
        eng, cfg = self._engine, self._engine.cfg
        if not self._started:
            self._start()
        t0 = time.perf_counter()
        start = self._generated
        want = cfg.first_chunk_frames if start == 0 else cfg.chunk_frames
        stop = min(start + max(1, want), self.max_frames)
        if stop <= start:
            return None
        base = len(self.prompt_tokens)  # backbone position of generated frame 0
        for i in range(start, stop):
            prev = self._buf[i - 1 : i] if i > 0 else None
            codes, self._h = eng.csm.frame_step(self._h, prev, base + i - 1, cfg.temperature, cfg.top_k,
                                                eng.generator)
            self._buf[i].copy_(codes[0])
        self._generated = stop
        host = self._buf[start:stop].cpu().numpy()  # the one sync per chunk
        ends = np.flatnonzero(~host.any(axis=1))
        valid = int(ends[0]) if len(ends) else len(host)
        if valid == 0:
            return None
        audio = eng.fns["decode"](self._decoder, self._buf[start : start + valid].T.unsqueeze(0))
        pcm = to_int16(audio)
        self._codes.append(host[:valid].copy())
        if valid < len(host) or stop >= self.max_frames:
            self._done = True  # the iteration ends after this chunk
            self.close()
        self.timings.setdefault("first_chunk_s", time.perf_counter() - t0 + self.timings["prefill_s"])
        self.timings["generate_s"] = self.timings.get("generate_s", 0.0) + time.perf_counter() - t0
        return pcm


class TTSEngine:
    """CSM + Mimi, one stream at a time (see the module docstring for the threading model)."""

    sample_rate = SAMPLE_RATE

    def __init__(self, cfg: TTSConfig | None = None):
        self.cfg = cfg = cfg or TTSConfig.tiny()
        self.device = torch.device(cfg.device)
        dtype = getattr(torch, cfg.dtype)
        if cfg.profile == "tiny":
            from pipeline.tokenizer import tiny_tokenizer

            self.tokenizer = tiny_tokenizer()
            self.csm: CSM = CSM(tiny_arch(len(self.tokenizer))).init_random(cfg.seed)
            self.csm = self.csm.to(device=self.device, dtype=dtype)
        elif cfg.profile == "full":  # CSM-1B's architecture with random weights (benchmarks, no download)
            from transformers import CsmConfig

            from pipeline.tokenizer import tiny_tokenizer
            from pipeline.tts.csm import arch_from_hf_config

            self.tokenizer = tiny_tokenizer()
            with torch.device(self.device):
                self.csm = CSM(arch_from_hf_config(CsmConfig())).init_random(cfg.seed)
            self.csm = self.csm.to(dtype=dtype)
        elif cfg.profile == "real":
            from pipeline.tokenizer import load_tokenizer

            self.tokenizer = load_tokenizer(cfg.tokenizer or cfg.csm)
            self.csm = load_csm(cfg.csm, device=cfg.device, dtype=dtype)
        else:
            raise ValueError(f"unknown TTS profile {cfg.profile!r}")
        self.csm.eval().requires_grad_(False)
        self.csm.setup_caches(cfg.max_seq_len)
        self.mimi = load_mimi(cfg.profile, cfg.mimi, device=cfg.device, seed=cfg.seed)
        self.mimi.requires_grad_(False)
        self.num_codebooks = self.csm.arch.num_codebooks
        self.csm.n_valid = min(self.csm.arch.audio_vocab, self.mimi.cardinality)
        self.prompts = PromptBuilder(self.tokenizer, self.num_codebooks)
        self.generator = torch.Generator(device=self.device).manual_seed(cfg.seed)
        self._lock = threading.Lock()
        self._current: TTSStream | None = None
        self._active = 0
        self.prefill_buckets = self._prefill_buckets()
        self.encode_buckets = tuple(sorted({int(b) for b in cfg.encode_buckets}))
        if not self.encode_buckets or self.encode_buckets[0] < 1:
            raise ValueError(f"encode_buckets must be positive frame counts, got {cfg.encode_buckets!r}")
        self._set_process_flags()
        self._build_static_fns()
        self.warm = False

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

    def _set_process_flags(self) -> None:
        """cuDNN autotuning off (unless configured): a new conv input length would start an
        algorithm search of seconds, cached per thread (docs/stall.md)."""
        if self.device.type == "cuda" or torch.cuda.is_available():
            torch.backends.cudnn.benchmark = bool(self.cfg.cudnn_benchmark)

    def _build_static_fns(self) -> None:
        cfg, csm = self.cfg, self.csm
        mode = cfg.compile_mode
        if mode is None and self.device.type == "cuda":
            mode = "reduce-overhead"  # CUDA graphs: static inputs are the step buffers and caches
        before = None
        if cfg.compile and mode == "reduce-overhead":
            before = torch.compiler.cudagraph_mark_step_begin
        if cfg.compile:  # one cache entry per bucket: make sure dynamo keeps them all
            need = max(len(self.prefill_buckets), len(self.encode_buckets)) + 2
            for name in ("recompile_limit", "cache_size_limit"):
                if hasattr(torch._dynamo.config, name) and getattr(torch._dynamo.config, name) < need:
                    setattr(torch._dynamo.config, name, need)

        def compiled(fn, fullgraph: bool):
            if not cfg.compile:
                return None
            kw: dict = dict(dynamic=False, fullgraph=fullgraph, backend=cfg.compile_backend)
            if mode and cfg.compile_backend == "inductor":
                kw["mode"] = mode
            return torch.compile(fn, **kw)

        def fn(name, f, fullgraph=True, compile_it=True):
            return StaticFn(name, f, compiled(f, fullgraph) if compile_it else None, cfg.slow_step_ms, before)

        self.fns: dict[str, StaticFn] = {
            "first_frame": fn("first_frame", csm.first_frame_fn),
            "next_frame": fn("next_frame", csm.next_frame_fn),
            "prefill": fn("prefill", csm.prefill_at),
            "encode": fn("encode", self._mimi_encode, fullgraph=False),
            # Mimi's streaming state holds Python ints (offsets): eager, in fixed-size pieces
            "encode_piece": fn("encode_piece", self._mimi_encode_piece, compile_it=False),
            "decode": fn("decode", self._decode_chunk, compile_it=False),
        }
        csm.set_step_fns(self.fns["first_frame"], self.fns["next_frame"])

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
    def prefill(self, tokens: np.ndarray, mask: np.ndarray) -> torch.Tensor:
        """Prompt rows ([L, 33]) padded at the end to their bucket -> last hidden state [1, D]."""
        rows = len(tokens)
        b = self.bucket_for(rows)
        tok = np.zeros((b, tokens.shape[1]), dtype=np.int64)
        msk = np.zeros((b, tokens.shape[1]), dtype=bool)
        tok[:rows], msk[:rows] = tokens, mask
        dev = self.device
        last = torch.tensor([rows - 1], dtype=torch.long, device=dev)
        h = self.fns["prefill"](torch.from_numpy(tok).to(dev)[None], torch.from_numpy(msk).to(dev)[None], last)
        return h.clone() if self.device.type == "cuda" else h  # CUDA-graph outputs are reused

    @property
    def active_requests(self) -> int:
        """Streams opened and not yet finished or closed."""
        return self._active

    def max_frames_for(self, text: str) -> int:
        """Frame budget of an utterance: ``frames_per_word`` per word (at least ``min_frames``), at
        most ``max_frames``. A trained CSM stops earlier on its own (all-zero frame); this bound is
        what ends speech for the random-weight tiny model, which rarely emits that frame."""
        words = max(1, len(text.split()))
        return max(1, min(self.cfg.max_frames, max(self.cfg.min_frames, math.ceil(self.cfg.frames_per_word * words))))

    def build_prompt(self, text: str, context: list[Segment] | None = None, speaker: int | None = None,
                     max_frames: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Prompt rows ([L, 33] tokens and mask) leaving room for ``max_frames`` generated frames."""
        max_frames = self.max_frames_for(text) if max_frames is None else max_frames
        speaker = self.cfg.speaker if speaker is None else speaker
        budget = self.cfg.max_seq_len - max_frames  # the context budget: oldest segments are dropped
        if self.cfg.max_prompt_rows is not None:
            budget = min(budget, self.cfg.max_prompt_rows)
        return self.prompts.build(speaker, text, context, budget)

    def stream(self, text: str, context: list[Segment] | None = None, speaker: int | None = None,
               max_frames: int | None = None) -> TTSStream:
        """Open a stream for ``text`` (work starts at the first ``next()``). Closes any open stream."""
        max_frames = self.max_frames_for(text) if max_frames is None else min(max_frames, self.cfg.max_frames)
        tokens, mask = self.build_prompt(text, context, speaker, max_frames)
        with self._lock:
            previous = self._current
        if previous is not None:
            previous.close()
        s = TTSStream(self, tokens, mask, max_frames)
        with self._lock:
            self._current = s
            self._active += 1
        return s

    def _release(self, s: TTSStream) -> None:
        with self._lock:
            self._active -= 1
            if self._current is s:
                self._current = None

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

    def _decode_chunk(self, decoder: StreamingDecoder, codes: torch.Tensor) -> torch.Tensor:
        return decoder.decode(codes)

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
        frames = -(-n // FRAME_SIZE)
        top = self.encode_buckets[-1]
        if frames <= top:
            b = next(b for b in self.encode_buckets if frames <= b)
            x = np.zeros(b * FRAME_SIZE, dtype=np.float32)
            x[:n] = wav
            codes = self.fns["encode"](torch.from_numpy(x).to(self.device).view(1, 1, -1))[0, :, :frames]
        else:
            piece = top * FRAME_SIZE
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
        from pipeline.audio import int16_to_float, resample

        return self.encode_wave(resample(int16_to_float(np.asarray(pcm_16k, dtype=np.int16)), USER_RATE, SAMPLE_RATE))

    # -- warm-up ----------------------------------------------------------------------------------
    @torch.inference_mode()
    def _run_every_shape(self) -> None:
        cfg, dev, k = self.cfg, self.device, self.num_codebooks
        for b in self.encode_buckets:  # each encode bucket, then the streaming path (2 pieces)
            self.encode_wave(np.zeros(b * FRAME_SIZE, dtype=np.float32))
        self.encode_wave(np.zeros(self.encode_buckets[-1] * FRAME_SIZE + 1, dtype=np.float32))
        self.encode_user_audio(np.zeros(USER_RATE // 10, dtype=np.int16))  # and the user path (resample)
        width = k + 1
        codes = None
        for b in self.prefill_buckets:  # each prefill bucket, the first and the later frame steps
            tokens = np.zeros((b, width), dtype=np.int64)
            mask = np.zeros((b, width), dtype=bool)
            mask[:, k] = True
            h = self.prefill(tokens, mask)
            codes, h = self.csm.frame_step(h, None, 0, cfg.temperature, cfg.top_k, self.generator)
            codes, h = self.csm.frame_step(h, codes, min(b, cfg.max_seq_len - 1), cfg.temperature, cfg.top_k,
                                           self.generator)
        sizes = sorted({cfg.first_chunk_frames, *range(1, cfg.chunk_frames + 1)})
        dec = StreamingDecoder(self.mimi)  # every chunk size of the streaming decode
        try:
            frame = torch.zeros(1, k, 1, dtype=torch.long, device=dev) if codes is None else codes.T[None]
            for n in sizes:
                self.fns["decode"](dec, frame.expand(1, k, n).contiguous())
        finally:
            dec.close()
        s = self.stream("Hello there.", max_frames=cfg.first_chunk_frames + cfg.chunk_frames)
        for _ in s:  # and the whole path once, as a request runs it
            pass
        s.close()

    def warmup(self) -> None:
        """Run every shape of the serving path on THIS thread (call it on the serving thread: some
        caches are per thread). With ``compile``: an eager pass first (Mimi's quantizer builds its
        tables on first use, so a compile before it would be traced twice), then the compiled pass.
        Then the gates are sealed and torch's compiler stance set to ``cfg.stance_after_warmup``."""
        passes = (True, False) if self.cfg.compile else (True,)
        t0 = time.perf_counter()
        try:
            for eager in passes:
                for f in self.fns.values():
                    f.force_eager = eager
                self._run_every_shape()
        finally:
            for f in self.fns.values():
                f.force_eager = False
        for f in self.fns.values():
            f.seal()
        self.warm = True
        if self.cfg.compile and self.cfg.stance_after_warmup != "default":
            torch.compiler.set_stance(self.cfg.stance_after_warmup)
        log.info("TTS warm in %.1f s: prefill buckets %s, encode buckets %s frames, compile=%s",
                 time.perf_counter() - t0, self.prefill_buckets, self.encode_buckets, self.cfg.compile)
