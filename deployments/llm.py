"""LLM deployment: token streams, cancellable mid-reply, stepped on one inference thread."""
from __future__ import annotations

import time

from ray import serve

from deployments.replica import ModelReplica
from pipeline import metrics
from pipeline.llm.config import LLMConfig


def _load(cfg: LLMConfig):
    from pipeline.llm import make_llm

    engine = make_llm(cfg)
    engine.warmup()
    return engine


@serve.deployment(ray_actor_options={"num_cpus": 0.5}, max_ongoing_requests=256)
class LLM(ModelReplica):
    def __init__(self, cfg: LLMConfig):
        self.cfg = cfg
        self.start_engine("llm", lambda: _load(cfg))

    async def stream(self, messages: list[dict]):
        """Yield text deltas of the reply to ``messages``; a cancelled call frees its state."""
        t0 = time.perf_counter()
        first = True
        async for delta in self.thread.iterate(self.engine.stream, messages):
            if first:
                metrics.LLM_TIME_TO_FIRST_TOKEN.observe(time.perf_counter() - t0)
                first = False
            yield delta

    async def stats(self) -> dict:
        return {"active_requests": self.engine.active_requests}
