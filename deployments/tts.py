"""TTS deployment: text in, int16 24 kHz audio chunks out, one stream at a time per replica.

Mimi's streaming decoder keeps its state inside the module, so a replica serializes its
streams (an asyncio lock held for a stream's life); chunks of one stream are stepped on the
inference thread one at a time, so a cancelled stream stops within one chunk."""
from __future__ import annotations

import asyncio
import time

from ray import serve

from deployments.replica import ModelReplica
from pipeline import metrics
from pipeline.tts.config import TTSConfig


def _load(cfg: TTSConfig):
    from pipeline.tts.engine import TTSEngine

    engine = TTSEngine(cfg)
    engine.warmup()
    return engine


@serve.deployment(ray_actor_options={"num_cpus": 0.75}, max_ongoing_requests=256)
class TTS(ModelReplica):
    def __init__(self, cfg: TTSConfig):
        self.cfg = cfg
        self.start_engine("tts", lambda: _load(cfg))
        self._lock = asyncio.Lock()

    async def stream(self, text: str):
        """Yield int16 mono 24 kHz numpy chunks speaking ``text``."""
        async with self._lock:
            t0 = time.perf_counter()
            samples = 0
            async for chunk in self.thread.iterate(self.engine.stream, text):
                if samples == 0:
                    metrics.TTS_TIME_TO_FIRST_CHUNK.observe(time.perf_counter() - t0)
                samples += len(chunk)
                yield chunk
            if samples:
                metrics.TTS_REAL_TIME_FACTOR.observe((time.perf_counter() - t0) / (samples / self.engine.sample_rate))

    async def stats(self) -> dict:
        return {"active_requests": self.engine.active_requests}
