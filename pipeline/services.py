"""Async services around the engines: what a deployment serves, without the framework.

Each service owns an engine and the one :class:`InferenceThread` that runs all its model
calls. Ray deployments (``deployments/``) are thin adapters over these; :class:`LocalBackends`
wires them in-process for tests and tools that run without Ray.
"""
from __future__ import annotations

import asyncio
import time
from collections import defaultdict
from typing import AsyncIterator

import numpy as np

from pipeline import metrics
from pipeline.runtime import InferenceThread
from pipeline.session import NoFreeSlot


def load_stt(cfg):
    """Build and warm the STT engine (call on the inference thread that will serve it)."""
    from pipeline.stt.engine import STTEngine

    engine = STTEngine.from_config(cfg)
    engine.warmup()
    return engine


def load_llm(cfg):
    from pipeline.llm import make_llm

    engine = make_llm(cfg)
    engine.warmup()
    return engine


def load_tts(cfg):
    from pipeline.tts.engine import TTSEngine

    engine = TTSEngine(cfg)
    engine.warmup()
    return engine


class STTService:
    """Many sessions' streams in one engine; every due chunk advances in one batched step."""

    def __init__(self, engine, thread: InferenceThread):
        self.engine, self.thread = engine, thread
        self._outbox: dict[str, list[dict]] = defaultdict(list)
        self._step_lock = asyncio.Lock()

    async def open(self, sid: str) -> str | None:
        """Take a slot for a session; returns None, or the reason it could not."""
        from pipeline.stt.engine import NoFreeSlotError

        try:
            await self.thread.run(self.engine.open, sid)
        except NoFreeSlotError as exc:
            return str(exc)
        metrics.STT_ACTIVE_STREAMS.set(len(self.engine.active_streams))
        return None

    async def push(self, sid: str, pcm: np.ndarray) -> list[dict]:
        """Buffer int16 audio for a session, run the steps now due, return its events."""
        audio = np.ascontiguousarray(pcm, dtype=np.float32) / 32768.0
        await self.thread.run(self.engine.feed, sid, audio)
        await self._drain()
        return self._outbox.pop(sid, [])

    async def _drain(self) -> None:
        # Whoever holds the lock steps for every stream; events wait in each session's outbox.
        async with self._step_lock:
            while await self.thread.run(self.engine.pending):
                t0 = time.perf_counter()
                events = await self.thread.run(self.engine.step)
                metrics.STT_STEP.observe(time.perf_counter() - t0)
                for ev in events:
                    self._outbox[ev.stream_id].append({"kind": ev.kind, "text": ev.text})

    async def finish(self, sid: str) -> tuple[str, list[dict]]:
        """The utterance's final text and its words with times (ms from the utterance start)."""
        self._outbox.pop(sid, None)
        text, _, words = await self.thread.run(self.engine.finish_result, sid)
        return text, words

    async def close(self, sid: str) -> None:
        self._outbox.pop(sid, None)
        await self.thread.run(self.engine.close, sid)
        metrics.STT_ACTIVE_STREAMS.set(len(self.engine.active_streams))

    def stats(self) -> dict:
        return {"active_streams": len(self.engine.active_streams)}


class LLMService:
    def __init__(self, engine, thread: InferenceThread):
        self.engine, self.thread = engine, thread

    async def stream(self, messages: list[dict]) -> AsyncIterator[str]:
        """Text deltas of the reply to ``messages``; a cancelled stream frees its state."""
        t0 = time.perf_counter()
        first = True
        async for delta in self.thread.iterate(self.engine.stream, messages):
            if first:
                metrics.LLM_TIME_TO_FIRST_TOKEN.observe(time.perf_counter() - t0)
                first = False
            yield delta

    def stats(self) -> dict:
        return {"active_requests": self.engine.active_requests}


class TTSService:
    """Text in, int16 24 kHz chunks out, one stream at a time: Mimi's streaming state lives in
    the module, so streams are serialized (a lock held for a stream's life); chunks are stepped
    one at a time, so a cancelled stream stops within one chunk. Stateless across requests: the
    conversation context comes with each request (the session owns it)."""

    def __init__(self, engine, thread: InferenceThread):
        self.engine, self.thread = engine, thread
        self._lock = asyncio.Lock()
        self._unseen = metrics.UNSEEN_SHAPES_AFTER_WARMUP.labels(deployment="tts")
        self._unseen.inc(0)
        self._unseen_seen = engine.stats()["unseen_shape_calls"]

    def _count_unseen_shapes(self) -> None:
        """Export the engine's count of calls with shapes warm-up did not cover (new ones only)."""
        now = self.engine.stats()["unseen_shape_calls"]
        if now > self._unseen_seen:
            self._unseen.inc(now - self._unseen_seen)
        self._unseen_seen = now

    def _chunks_with_codes(self, text: str, context: list | None):
        """Runs on the inference thread: (pcm chunk, codes of the frames that made it)."""
        stream = self.engine.stream(text, context=context)
        try:
            done = 0
            for pcm in stream:
                codes = stream.codes
                yield pcm, np.ascontiguousarray(codes[done:])
                done = len(codes)
        finally:
            stream.close()

    async def stream(self, text: str, context: list | None = None) -> AsyncIterator[tuple[np.ndarray, np.ndarray]]:
        async with self._lock:
            t0 = time.perf_counter()
            samples = 0
            async for pcm, codes in self.thread.iterate(self._chunks_with_codes, text, context):
                if samples == 0:
                    metrics.TTS_TIME_TO_FIRST_CHUNK.observe(time.perf_counter() - t0)
                samples += len(pcm)
                yield pcm, codes
            if samples:
                audio_s = samples / self.engine.sample_rate
                metrics.TTS_REAL_TIME_FACTOR.observe((time.perf_counter() - t0) / audio_s)
            self._count_unseen_shapes()

    async def encode(self, pcm_16k: np.ndarray) -> np.ndarray:
        """A user turn's audio (int16, 16 kHz) to Mimi codes [T, 32], once, for the context."""
        codes = await self.thread.run(self.engine.encode_user_audio, pcm_16k)
        self._count_unseen_shapes()
        return codes

    def stats(self) -> dict:
        return {"active_requests": self.engine.active_requests}


class LocalBackends:
    """The session's :class:`~pipeline.session.Backends` over in-process services (no Ray)."""

    def __init__(self, stt: STTService, llm: LLMService, tts: TTSService):
        self.stt, self.llm, self.tts = stt, llm, tts

    @classmethod
    def build(cls, stt_cfg, llm_cfg, tts_cfg) -> "LocalBackends":
        """Load and warm the three engines, each on its own inference thread."""
        services = []
        for name, load, svc in (("stt", load_stt, STTService), ("llm", load_llm, LLMService), ("tts", load_tts, TTSService)):
            thread = InferenceThread(name)
            services.append(svc(thread.call(load, {"stt": stt_cfg, "llm": llm_cfg, "tts": tts_cfg}[name]), thread))
        return cls(*services)

    async def stt_open(self, sid: str) -> None:
        reason = await self.stt.open(sid)
        if reason:
            raise NoFreeSlot(reason)

    async def stt_push(self, sid: str, pcm: np.ndarray) -> list[dict]:
        return await self.stt.push(sid, pcm)

    async def stt_finish(self, sid: str) -> tuple[str, list[dict]]:
        return await self.stt.finish(sid)

    async def stt_close(self, sid: str) -> None:
        await self.stt.close(sid)

    def llm_stream(self, messages: list[dict]) -> AsyncIterator[str]:
        return self.llm.stream(messages)

    def tts_stream(self, text: str, context: list) -> AsyncIterator[tuple[np.ndarray, np.ndarray]]:
        return self.tts.stream(text, context)

    async def tts_encode(self, pcm: np.ndarray) -> np.ndarray:
        return await self.tts.encode(pcm)
