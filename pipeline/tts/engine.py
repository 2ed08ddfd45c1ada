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
"""
from __future__ import annotations

import math
import threading
import time

import numpy as np
import torch

from pipeline.tts.config import TTSConfig
from pipeline.tts.csm import CSM, load_csm, tiny_arch
from pipeline.tts.mimi import SAMPLE_RATE, StreamingDecoder, load_mimi, to_int16
from pipeline.tts.prompt import PromptBuilder, Segment

__all__ = ["TTSEngine", "TTSStream", "Segment"]


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
        tokens = torch.from_numpy(self.prompt_tokens).to(dev).unsqueeze(0)
        mask = torch.from_numpy(self.prompt_mask).to(dev).unsqueeze(0)
        self._h = eng.csm.prefill(tokens, mask)
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
        audio = self._decoder.decode(self._buf[start : start + valid].T.unsqueeze(0))
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
        return self.prompts.build(speaker, text, context, self.cfg.max_seq_len - max_frames)

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

    @torch.inference_mode()
    def encode(self, pcm_24k: np.ndarray) -> np.ndarray:
        """User audio (int16 or float in [-1, 1], mono 24 kHz) -> Mimi codes [T, 32] int64."""
        x = np.asarray(pcm_24k)
        x = x.astype(np.float32) / 32768.0 if x.dtype == np.int16 else x.astype(np.float32)
        wav = torch.from_numpy(x.reshape(1, 1, -1)).to(self.device)
        codes = self.mimi.encode(wav)[0].T  # [T, 32]
        return codes.cpu().numpy().astype(np.int64)

    def warmup(self) -> None:
        """Run every code path once (prefill, frame steps, streaming decode, encode) on this thread."""
        self.encode(np.zeros(SAMPLE_RATE // 2, dtype=np.int16))
        s = self.stream("Hello there.", max_frames=self.cfg.first_chunk_frames + self.cfg.chunk_frames)
        for _ in s:
            pass
        s.close()
