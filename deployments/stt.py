"""STT deployment: a thin adapter over :class:`pipeline.services.STTService`.

Stream state lives in the replica that opened the stream, so calls are routed by Ray Serve's
consistent-hash router on the stream id (the gateway sets ``session_id`` on the handle), with
no fallback replica: a call never lands on a replica that does not hold its stream while that
replica lives. When the ring changes (a replica dies or is added), a moved stream's next call
gets UnknownStream and its session restarts the turn on the new owner (docs/scaling.md)."""
from __future__ import annotations

import numpy as np
from ray import serve
from ray.serve.config import RequestRouterConfig

from deployments.autoscaling import slot_stats
from deployments.replica import ModelReplica
from pipeline.services import load_stt, STTService
from pipeline.stt.config import STTConfig


STICKY_ROUTER = RequestRouterConfig(
    request_router_class="ray.serve.experimental.consistent_hash_router.ConsistentHashRouter",
    request_router_kwargs={"num_virtual_nodes": 100, "num_fallback_replicas": 0},
)


@serve.deployment(ray_actor_options={"num_cpus": 0.5}, max_ongoing_requests=1024, num_replicas=1,
                  request_router_config=STICKY_ROUTER)
class STT(ModelReplica):
    def __init__(self, cfg: STTConfig):
        self.start_engine("stt", cfg, load_stt)
        replica = serve.get_replica_context().replica_id.unique_id
        self.svc = STTService(self.engine, self.thread, replica=replica)

    async def open(self, sid: str, language: str | None = None) -> str | None:
        return await self.svc.open(sid, language)

    async def push(self, sid: str, pcm: np.ndarray) -> list[dict]:
        return await self.svc.push(sid, pcm)

    async def finish(self, sid: str) -> tuple[str, list[dict]]:
        return await self.svc.finish(sid)

    async def peek(self, sid: str) -> tuple[str, list[dict]] | None:
        return await self.svc.peek(sid)

    async def close(self, sid: str) -> None:
        await self.svc.close(sid)

    def record_autoscaling_stats(self) -> dict[str, int]:
        """Slots in use and slot count, for deployments.autoscaling.SlotPolicy (polled by Serve only
        while this deployment has an autoscaling_config)."""
        stats = self.svc.stats()
        return slot_stats(stats["active_streams"], stats["slots"])
