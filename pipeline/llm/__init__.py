"""The LLM stage: streaming, cancellable text generation behind one interface.

``make_llm(cfg)`` returns an engine with ``warmup()``, ``active_requests`` and either
``stream(messages) -> iterator of text deltas`` (``.close()`` cancels; every call on the
replica's inference thread) or, for engines that only wait on the network,
``astream(messages) -> async iterator of text deltas`` (``aclose()`` cancels; on the event loop):

* ``"transformers"``: :class:`pipeline.llm.engine.LLMEngine` (in-process, static KV cache);
* ``"openai"``: :class:`pipeline.llm.openai_backend.OpenAIEngine` (any OpenAI-compatible server; ``astream``);
* ``"vllm"``: :class:`pipeline.llm.vllm_backend.VLLMEngine` (optional GPU extra; untested here).
"""
from __future__ import annotations

from typing import Any

from pipeline.llm.config import LLMConfig
from pipeline.llm.engine import approx_token_count, build_prompt

__all__ = ["LLMConfig", "make_llm", "build_prompt", "approx_token_count", "BACKENDS"]

BACKENDS = ("transformers", "openai", "vllm")


def make_llm(cfg: LLMConfig) -> Any:
    """The engine for ``cfg.backend``."""
    backend = (cfg.backend or "").lower()
    if backend == "transformers":
        from pipeline.llm.engine import LLMEngine

        return LLMEngine(cfg)
    if backend == "openai":
        from pipeline.llm.openai_backend import OpenAIEngine

        return OpenAIEngine(cfg)
    if backend == "vllm":
        try:
            import vllm  # noqa: F401
        except ImportError as exc:
            raise RuntimeError(
                "LLM backend 'vllm' needs the optional GPU extra: `pip install .[gpu]` (vllm is not "
                "installed). Use backend='transformers', or run a vLLM server and use "
                "backend='openai' with openai_url pointing at it."
            ) from exc
        from pipeline.llm.vllm_backend import VLLMEngine

        return VLLMEngine(cfg)
    raise ValueError(f"unknown LLM backend {cfg.backend!r}; expected one of {BACKENDS}")
