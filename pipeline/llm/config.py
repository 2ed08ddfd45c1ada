"""Settings of the LLM stage: which backend, which model, how to sample, how much context."""
from __future__ import annotations

import os
from dataclasses import dataclass, field, replace

DEFAULT_SYSTEM_PROMPT = (
    "You are a helpful voice assistant. Your replies are spoken aloud, so answer in one to "
    "three short, plain sentences, without lists, markdown, emoji or code."
)


PROFILES = ("tiny", "full", "real")
REAL_MODEL = "Qwen/Qwen2.5-0.5B-Instruct"


def _env_api_key() -> str | None:
    return os.environ.get("OPENAI_API_KEY") or None


@dataclass
class LLMConfig:
    """Configuration of the LLM stage.

    ``backend``: ``"transformers"`` (in-process, :class:`pipeline.llm.engine.LLMEngine`),
    ``"openai"`` (any OpenAI-compatible HTTP server) or ``"vllm"`` (optional GPU extra).
    ``profile``, the same vocabulary as the STT and TTS configs: ``"tiny"`` (a small random
    Llama-family model built in code over the tiny tokenizer: tests and CPU runs), ``"full"``
    (random weights at Qwen2.5-0.5B's transformer shape: GPU timing without a checkpoint) or
    ``"real"`` (the checkpoint ``model``). Only the transformers backend reads it: ``openai`` and
    ``vllm`` serve a real model whatever it says.
    """

    profile: str = "real"
    backend: str = "transformers"
    model: str = REAL_MODEL  # HF id or local path: the checkpoint of profile real (and of the vllm backend)
    system_prompt: str = DEFAULT_SYSTEM_PROMPT
    max_output_tokens: int = 128  # new tokens of one reply at most; a session may choose its own
    temperature: float = 0.7
    top_k: int = 50
    top_p: float = 0.9
    history_tokens: int = 1024  # token budget of the templated prompt (system + history)
    max_context_tokens: int = 2048  # static KV cache length (prompt + generated tokens)
    device: str = "auto"  # "auto" -> cuda when available, else cpu
    dtype: str = "auto"  # "auto" -> bfloat16 on cuda, float32 on cpu
    seed: int = 0
    max_tool_call_tokens: int = 256  # new tokens of a forced tool call at most (its arguments must fit)
    # OpenAI-compatible backend
    openai_url: str = "http://127.0.0.1:8000/v1"
    openai_model: str = REAL_MODEL
    openai_api_key: str | None = field(default_factory=_env_api_key, repr=False)  # never printed with the config
    openai_timeout_s: float = 30.0
    # shape of the random-weight model (profiles tiny and full; the real profile reads the checkpoint's)
    tiny_layers: int = 2
    tiny_hidden: int = 64
    tiny_heads: int = 4
    tiny_kv_heads: int = 2
    tiny_intermediate: int | None = None  # MLP width; None = 2 x tiny_hidden

    @classmethod
    def tiny(cls, **overrides) -> "LLMConfig":
        """A tiny random Llama model with the tiny tokenizer: CPU-fast, deterministic."""
        base = cls(
            profile="tiny",
            backend="transformers",
            max_output_tokens=24,
            # sampled (seeded per stream), so random weights do not repeat one token forever
            temperature=0.9,
            top_k=40,
            history_tokens=192,
            # room for tools in the prompt (their schemas, a few hundred tiny-vocabulary tokens) and a
            # forced call's arguments (max_tool_call_tokens)
            max_context_tokens=1024,
            device="cpu",
            dtype="float32",
        )
        return replace(base, **overrides)

    @classmethod
    def full(cls, **overrides) -> "LLMConfig":
        """Random weights with Qwen2.5-0.5B's transformer shape (24 layers of 896, 14/2 heads, MLP
        4864) over the tiny tokenizer's vocabulary: GPU timing without a checkpoint."""
        base = replace(cls.tiny(), profile="full", tiny_layers=24, tiny_hidden=896, tiny_heads=14, tiny_kv_heads=2,
                       tiny_intermediate=4864, max_output_tokens=128, history_tokens=1024, max_context_tokens=2048,
                       device="cuda", dtype="bfloat16")
        return replace(base, **overrides)

    @classmethod
    def real(cls, **overrides) -> "LLMConfig":
        """The real default: Qwen2.5-0.5B-Instruct (must be in the local HF cache)."""
        return replace(cls(profile="real"), **overrides)

    def __post_init__(self) -> None:
        if self.profile not in PROFILES:
            raise ValueError(f"LLMConfig.profile must be 'tiny', 'full' or 'real', got {self.profile!r}")
        if self.model == "tiny":  # the old spelling of the tiny model (before profiles)
            raise ValueError("LLMConfig(model='tiny') is now LLMConfig(profile='tiny') (or LLMConfig.tiny())")

