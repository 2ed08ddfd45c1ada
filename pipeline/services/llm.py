"""The LLM's service: a reply's text deltas and tool calls, streamed."""
from __future__ import annotations

import contextlib
import time
from typing import AsyncIterator

from pipeline import metrics
from pipeline.engines import LLMFinish, Sampling, ToolCall
from pipeline.llm.tool_calls import ToolCallParser
from pipeline.runtime.threads import InferenceThread


def load_llm(cfg):
    from pipeline.llm import make_llm

    engine = make_llm(cfg)
    engine.warmup()
    return engine


def _finish(stream) -> LLMFinish | None:
    """Why a model engine's stream stopped, with its token counts (read on the inference thread)."""
    reason = getattr(stream, "finish_reason", None)
    if reason not in ("stop", "length"):
        return None
    prompt, generated = getattr(stream, "prompt_ids", None), getattr(stream, "generated", None)
    return LLMFinish(reason, None if prompt is None else len(prompt), None if generated is None else len(generated))


class LLMService:
    """Streams of one LLM engine: a model engine (``stream``) steps on the inference thread, an
    HTTP engine (``astream``) waits on the event loop, so a slow upstream holds up no other stream."""

    def __init__(self, engine, thread: InferenceThread):
        self.engine, self.thread = engine, thread

    async def stream(self, messages: list[dict], sampling: Sampling = Sampling()
                     ) -> AsyncIterator[str | ToolCall | LLMFinish]:
        """Text deltas and tool calls of the reply to ``messages``, sampled as ``sampling``, then an
        :class:`LLMFinish` where the engine tells why it stopped. A model engine writes calls in its
        own text; they are parsed out here (``pipeline.llm.tool_calls``), so the text before a call
        streams on as it comes.

        Closing or cancelling this generator closes the engine's stream at once (the model's on
        the inference thread), not whenever the garbage collector finds it."""
        t0 = time.perf_counter()
        first = True
        parser = ToolCallParser() if sampling.tools and not hasattr(self.engine, "astream") else None
        async with contextlib.aclosing(self._deltas(messages, sampling)) as deltas:
            async for delta in deltas:
                if first:
                    metrics.LLM_TIME_TO_FIRST_TOKEN.observe(time.perf_counter() - t0)
                    first = False
                if parser is None:
                    yield delta
                    continue
                for item in parser.push(delta) if isinstance(delta, str) else [*parser.flush(), delta]:
                    yield item
            for item in parser.flush() if parser is not None else ():  # a stream that ended without LLMFinish
                yield item

    def _deltas(self, messages: list[dict], sampling: Sampling) -> AsyncIterator[str | ToolCall | LLMFinish]:
        if hasattr(self.engine, "astream"):
            return self.engine.astream(messages, sampling)
        return self.thread.iterate(self.engine.stream, messages, sampling, last=_finish)

    def stats(self) -> dict:
        return {"active_requests": self.engine.active_requests}
