"""TTS deployment: a thin adapter over :class:`pipeline.services.TTSService`.

A server may serve two families, each its own deployment (TTS, and TTS_<family>: pipeline/tts/families.py).
A family that takes words (DSM) holds each reply's utterance in the replica that opened it: the
app builder then gives this deployment the STT's consistent-hash router, and the gateway sets the
utterance id as the routing key of its calls (``deployments/backends.py``)."""
from __future__ import annotations

from ray import serve

from deployments.autoscaling import slot_stats
from deployments.replica import ModelReplica
from pipeline.audio_constants import USER_RATE
from pipeline.services import load_tts, TTSService
from pipeline.tts.config import TTSConfig


@serve.deployment(ray_actor_options={"num_cpus": 0.75}, max_ongoing_requests=256)
class TTS(ModelReplica):
    def __init__(self, cfg: TTSConfig, name: str = "tts"):
        """``name``: the deployment's, lower case, as its metrics are labelled (tts; a second family's tts_<family>)."""
        self.start_engine(name, cfg, load_tts)
        self.svc = TTSService(self.engine, self.thread, label=name)

    async def stream(self, text: str, context: list | None = None, voice=None):
        async for item in self.svc.stream(text, context, voice):
            yield item

    async def open(self, uid: str, voice=None) -> None:
        await self.svc.open(uid, voice)

    async def feed(self, uid: str, pieces: list[tuple[str, bool]], final: bool = False):
        return await self.svc.feed(uid, pieces, final)

    async def close(self, uid: str) -> None:
        await self.svc.close(uid)

    async def encode(self, pcm, rate: int = USER_RATE):
        return await self.svc.encode(pcm, rate)

    def record_autoscaling_stats(self) -> dict[str, int]:
        """Streams holding or waiting for a slot (so occupancy can pass 1), and the slot count, for
        deployments.autoscaling.SlotPolicy (polled only while the deployment autoscales)."""
        stats = self.svc.stats()
        return slot_stats(stats["active_requests"], stats["slots"])
