"""LLM deployment: a thin adapter over :class:`pipeline.services.LLMService`."""
from __future__ import annotations

from ray import serve

from deployments.replica import ModelReplica
from pipeline.engines import Sampling
from pipeline.llm.config import LLMConfig
from pipeline.services import load_llm, LLMService


@serve.deployment(ray_actor_options={"num_cpus": 0.5}, max_ongoing_requests=256)
class LLM(ModelReplica):
    def __init__(self, cfg: LLMConfig):
        self.start_engine("llm", cfg, load_llm)
        self.svc = LLMService(self.engine, self.thread)

    async def stream(self, messages: list[dict], sampling: Sampling):
        async for delta in self.svc.stream(messages, sampling):
            yield delta
