"""STT deployment: many sessions' streams in one engine, stepped in batches on one thread.

Stream state lives in this replica, so the STT deployment runs one replica per app (scale
by adding apps or GPUs, not replicas, until sessions are routed sticky)."""
from __future__ import annotations

import asyncio
import time
from collections import defaultdict

import numpy as np
from ray import serve

from deployments.replica import ModelReplica
from pipeline import metrics
from pipeline.stt.config import STTConfig


def _load(cfg: STTConfig):
    from pipeline.stt.engine import STTEngine

    engine = STTEngine.from_config(cfg)
    engine.warmup()
    return engine


@serve.deployment(ray_actor_options={"num_cpus": 0.5}, max_ongoing_requests=1024, num_replicas=1)
class STT(ModelReplica):
    def __init__(self, cfg: STTConfig):
        self.cfg = cfg
        self.start_engine("stt", lambda: _load(cfg))
        self._outbox: dict[str, list[dict]] = defaultdict(list)
        self._step_lock = asyncio.Lock()

    async def open(self, sid: str) -> str | None:
        """Take a slot for a session; returns None, or the reason it could not."""
        from pipeline.stt.engine import NoFreeSlotError

        try:
            await self.thread.run(self.engine.open, sid)
        except NoFreeSlotError as exc:
            return str(exc)
        metrics.STT_ACTIVE_STREAMS.set(self.engine.active_streams)
        return None

    async def push(self, sid: str, pcm: np.ndarray) -> list[dict]:
        """Buffer int16 audio for a session, run the batched steps now due, return its events."""
        audio = np.ascontiguousarray(pcm, dtype=np.float32) / 32768.0
        await self.thread.run(self.engine.feed, sid, audio)
        await self._drain()
        return self._outbox.pop(sid, [])

    async def _drain(self) -> None:
        # One step advances every stream with a full chunk; whoever holds the lock steps for all.
        async with self._step_lock:
            while await self.thread.run(self.engine.pending):
                t0 = time.perf_counter()
                events = await self.thread.run(self.engine.step)
                metrics.STT_STEP.observe(time.perf_counter() - t0)
                for ev in events:
                    self._outbox[ev.stream_id].append({"kind": ev.kind, "text": ev.text})

    async def finish(self, sid: str) -> str:
        self._outbox.pop(sid, None)
        return await self.thread.run(self.engine.finish, sid)

    async def close(self, sid: str) -> None:
        self._outbox.pop(sid, None)
        await self.thread.run(self.engine.close, sid)
        metrics.STT_ACTIVE_STREAMS.set(self.engine.active_streams)

    async def stats(self) -> dict:
        return {"active_streams": self.engine.active_streams}
