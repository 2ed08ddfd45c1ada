"""STT deployment: a thin adapter over :class:`pipeline.services.STTService`.

Stream state lives in this replica, so the STT deployment runs one replica per app (scale
by adding apps or GPUs, not replicas, until sessions are routed sticky)."""
from __future__ import annotations

import numpy as np
from ray import serve

from deployments.replica import ModelReplica
from pipeline.services import load_stt, STTService
from pipeline.stt.config import STTConfig


@serve.deployment(ray_actor_options={"num_cpus": 0.5}, max_ongoing_requests=1024, num_replicas=1)
class STT(ModelReplica):
    def __init__(self, cfg: STTConfig):
        self.start_engine("stt", lambda: load_stt(cfg))
        self.svc = STTService(self.engine, self.thread)

    async def open(self, sid: str) -> str | None:
        return await self.svc.open(sid)

    async def push(self, sid: str, pcm: np.ndarray) -> list[dict]:
        return await self.svc.push(sid, pcm)

    async def finish(self, sid: str) -> tuple[str, list[dict]]:
        return await self.svc.finish(sid)

    async def close(self, sid: str) -> None:
        await self.svc.close(sid)

    async def stats(self) -> dict:
        return self.svc.stats()
