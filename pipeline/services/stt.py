"""The recogniser's service: many sessions' streams in one engine, a turn per stream."""
from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING

import numpy as np

from pipeline import metrics
from pipeline.engines import NoFreeSlot, UnknownStream
from pipeline.runtime.threads import InferenceThread

if TYPE_CHECKING:
    from pipeline.stt.engine import STTEvent

log = logging.getLogger(__name__)


def load_stt(cfg):
    """Build and warm the STT engine (call on the inference thread that will serve it)."""
    from pipeline.stt.engine import STTEngine

    engine = STTEngine.from_config(cfg)
    engine.warmup()
    return engine


class STTService:
    """Many sessions' streams in one engine; every due chunk advances in one batched step.

    A stream is one spoken turn: ``open`` takes a slot, ``finish`` returns the turn's transcript
    and gives the slot back in the same round trip, ``close`` gives it back without one.

    A call for a stream this service does not hold raises :class:`UnknownStream` (counted: with
    sticky routing it means a misroute or a replaced replica). Opening an open stream id restarts
    it (its caller gave up on the old one, e.g. after a timeout). A stream no call has touched for
    ``stale_after_s`` is abandoned (its session's calls now reach another replica) and is closed
    when a new stream needs its slot."""

    def __init__(self, engine, thread: InferenceThread, stale_after_s: float = 120.0, replica: str = ""):
        self.engine, self.thread = engine, thread
        self.stale_after_s = stale_after_s
        self.replica = replica  # label of this replica's metrics
        # Events waiting for their stream's next push; a key exists exactly while the stream is open,
        # so a step that finishes after its stream closed leaves nothing behind.
        self._outbox: dict[str, list[dict]] = {}
        self._last_call: dict[str, float] = {}  # stream id -> monotonic time of its last call
        self._finals: dict[str, "STTEvent"] = {}  # an ended stream's final event, until finish takes it
        self._step_lock = asyncio.Lock()

    async def open(self, sid: str, language: str | None = None) -> str | None:
        """Take a slot for a spoken turn heard as ``language`` (None: the model's default); returns
        None, or the reason it could not. A language the model does not speak raises ValueError."""
        if sid in self._outbox:
            await self.close(sid)
        # Noted before the engine call: an open whose caller gave up (cancelled midway, after the
        # engine took the slot) is still closed by the stale sweep.
        self._last_call[sid] = time.monotonic()
        for retry in (False, True):  # once more after closing abandoned streams, if there were any
            try:
                await self.thread.run(self.engine.open, sid, language)
                break
            except NoFreeSlot as exc:
                if retry or not await self._close_stale():
                    self._last_call.pop(sid, None)
                    return str(exc)
        self._outbox[sid] = []
        self._last_call[sid] = time.monotonic()
        metrics.STT_STREAMS_OPENED.labels(replica=self.replica).inc()
        self._export_active()
        return None

    async def _close_stale(self) -> int:
        now = time.monotonic()
        stale = [sid for sid, t in self._last_call.items() if now - t > self.stale_after_s]
        for sid in stale:
            log.warning("STT stream %s untouched for %.0f s: closing it", sid, now - self._last_call[sid])
            await self.close(sid)
        return len(stale)

    def _known(self, sid: str) -> None:
        if sid not in self._outbox:
            metrics.STT_UNKNOWN_STREAMS.labels(replica=self.replica).inc()
            raise UnknownStream(f"this STT replica holds no stream {sid!r}")
        self._last_call[sid] = time.monotonic()

    async def push(self, sid: str, pcm: np.ndarray) -> list[dict]:
        """Buffer int16 audio for a stream, run the steps now due, return its events."""
        self._known(sid)
        audio = np.ascontiguousarray(pcm, dtype=np.float32) / 32768.0
        await self.thread.run(self.engine.feed, sid, audio)
        await self._drain()
        events = self._outbox.get(sid) or []
        if events:
            self._outbox[sid] = []
        return events

    async def _drain(self) -> None:
        # Whoever holds the lock steps for every stream; events wait in each open stream's outbox.
        async with self._step_lock:
            while await self.thread.run(self.engine.pending):
                t0 = time.perf_counter()
                events = await self.thread.run(self.engine.step)
                metrics.STT_STEP.observe(time.perf_counter() - t0)
                for ev in events:
                    outbox = self._outbox.get(ev.stream_id)
                    if outbox is None:  # closed while this step ran: nobody will collect them
                        continue
                    if ev.kind == "final":
                        self._finals[ev.stream_id] = ev
                    else:
                        outbox.append({"kind": ev.kind, "text": ev.text})

    async def finish(self, sid: str) -> tuple[str, list[dict]]:
        """The turn's final text and its words with times (ms from the turn's first recognised
        audio). The turn's last chunk is decoded in the same batched steps as other streams'
        chunks; the slot is free again when this returns, even if decoding failed."""
        self._known(sid)
        try:
            await self.thread.run(self.engine.end, sid)
            await self._drain()  # steps until nothing is due: the stream's final came in one of them
            final = self._finals.pop(sid, None)
            if final is None:
                raise RuntimeError(f"STT stream {sid!r} ended without a final transcript")
            return final.text, final.words
        finally:
            self._outbox.pop(sid, None)
            self._finals.pop(sid, None)
            self._last_call.pop(sid, None)
            await self.thread.run(self.engine.close, sid)
            self._export_active()

    async def peek(self, sid: str) -> tuple[str, list[dict]] | None:
        """The transcript and words ``finish`` would give now, while the stream stays open for more
        audio: the stream is copied into a spare slot (STTEngine.fork), which is ended and freed.
        None when no slot is spare (nothing else changes)."""
        self._known(sid)
        fork = f"{sid}#peek"
        try:
            await self.thread.run(self.engine.fork, sid, fork)
        except NoFreeSlot:
            return None
        self._outbox[fork] = []
        try:
            await self.thread.run(self.engine.end, fork)
            await self._drain()
            final = self._finals.pop(fork, None)
            return None if final is None else (final.text, final.words)
        finally:
            self._outbox.pop(fork, None)
            self._finals.pop(fork, None)
            await self.thread.run(self.engine.close, fork)

    async def close(self, sid: str) -> None:
        """Give the slot back without a transcript (session gone); closing twice is harmless."""
        self._outbox.pop(sid, None)
        self._finals.pop(sid, None)
        self._last_call.pop(sid, None)
        await self.thread.run(self.engine.close, sid)
        self._export_active()

    def _export_active(self) -> None:
        metrics.STT_ACTIVE_STREAMS.set(len(self.engine.active_streams))

    def stats(self) -> dict:
        """Open streams (one slot each) and the engine's slot count (what autoscaling reads)."""
        return {"active_streams": len(self.engine.active_streams), "slots": self.engine.num_slots}
