"""The in-process vLLM backend (optional GPU extra: ``pip install .[gpu]``).

vLLM's synchronous ``LLMEngine`` fits the replica's one-inference-thread model: every stream's
``next()`` runs on that thread and calls ``engine.step()`` when it has nothing buffered, and one
step advances *all* open requests (vLLM batches them continuously), buffering the others' output
for their own ``next()``. ``close()`` aborts the request. Untested on this repository's CI
(no GPU, vllm not installed there); the interface is the same as the transformers backend.
"""
from __future__ import annotations

import itertools
from collections import deque
from typing import Any, Iterator

from pipeline.engines import Sampling
from pipeline.llm.config import LLMConfig
from pipeline.llm.engine import build_prompt
from pipeline.runtime.weights import require_pretrained


class VLLMEngine:
    def __init__(self, cfg: LLMConfig):
        from vllm import EngineArgs, LLMEngine

        self.cfg = cfg
        path = require_pretrained(cfg.model, what="LLM")
        dtype = "auto" if cfg.dtype == "auto" else cfg.dtype
        self.engine = LLMEngine.from_engine_args(
            EngineArgs(model=path, dtype=dtype, max_model_len=cfg.max_context_tokens, seed=cfg.seed)
        )
        self.tokenizer = self.engine.get_tokenizer()
        self._ids = itertools.count()
        self._buffers: dict[str, deque] = {}

    @property
    def active_requests(self) -> int:
        return len(self._buffers)

    def warmup(self) -> None:
        for _ in self.stream([{"role": "user", "content": "Hello."}], Sampling(max_output_tokens=4)):
            pass

    def _count(self, messages: list[dict]) -> int:
        return len(self.tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True))

    def stream(self, messages: list[dict], sampling: Sampling = Sampling()) -> "VLLMStream":
        """As LLMEngine.stream: tools go to the model's chat template, its calls come back in its own
        text (the Hermes format, which the service parses; a model needs a template that writes it,
        as Qwen2.5's does). A forced call (``required`` or a named function) is guided by the same
        llguidance grammar as the local engine's, through vLLM's structured outputs."""
        from vllm import SamplingParams

        from pipeline.llm.tool_calls import template_messages, template_tools

        cfg, tools, temperature = self.cfg, sampling.tools, sampling.temperature
        max_new = cfg.max_output_tokens if sampling.max_output_tokens is None else sampling.max_output_tokens
        budget = min(cfg.history_tokens, cfg.max_context_tokens - max_new)
        msgs = build_prompt(messages, cfg.system_prompt, budget, count_tokens=self._count)
        prompt = self.tokenizer.apply_chat_template(template_messages(msgs), tools=template_tools(tools), tokenize=False,
                                                    add_generation_prompt=True)
        guided = _forced_call(tools, sampling.tool_choice)
        params = SamplingParams(
            max_tokens=max(max_new, cfg.max_tool_call_tokens) if guided else max_new,
            temperature=cfg.temperature if temperature is None else float(temperature),
            top_k=cfg.top_k if cfg.top_k and cfg.top_k > 0 else -1,
            top_p=cfg.top_p,
            **guided,
        )
        rid = f"r{next(self._ids)}"
        self._buffers[rid] = deque()
        self.engine.add_request(rid, prompt, params)
        return VLLMStream(self, rid)

    def _step(self) -> None:
        for out in self.engine.step():
            buf = self._buffers.get(out.request_id)
            if buf is not None:
                buf.append((out.outputs[0].text, out.finished, out.outputs[0].finish_reason,
                            len(out.prompt_token_ids or ()), len(out.outputs[0].token_ids or ())))


class VLLMStream(Iterator[str]):
    """Text deltas of one request (vLLM reports cumulative text; we send the new part)."""

    def __init__(self, engine: VLLMEngine, rid: str):
        self.engine, self.rid = engine, rid
        self.text = ""
        self._done = False
        self.finish_reason: str | None = None  # "stop" | "length" once finished
        self.prompt_ids: range = range(0)  # sized like the prompt, for the token count
        self.generated: range = range(0)

    def __next__(self) -> str:
        buf = self.engine._buffers.get(self.rid)
        while not self._done and buf is not None:
            while not buf:
                self.engine._step()
            text, finished, reason, prompt_tokens, generated = buf.popleft()
            delta, self.text = text[len(self.text):], text
            if finished:
                self.finish_reason = reason
                self.prompt_ids, self.generated = range(prompt_tokens), range(generated)
                self._release()
            if delta:
                return delta
        raise StopIteration

    def _release(self) -> None:
        self._done = True
        self.engine._buffers.pop(self.rid, None)

    def close(self) -> None:
        if not self._done:
            self.engine.engine.abort_request(self.rid)
            self._release()


def _forced_call(tools: list[dict] | None, tool_choice: str | dict | None) -> dict[str, Any]:
    """SamplingParams keywords that force one tool call (vLLM's structured outputs with the
    llguidance grammar; its name changed across vLLM versions). Untested here: no GPU, no vLLM."""
    if not tools or tool_choice in (None, "auto", "none"):
        return {}
    from pipeline.llm.tool_calls import chosen_tools, forced_call_grammar

    grammar = forced_call_grammar(chosen_tools(tools, tool_choice))
    try:
        from vllm.sampling_params import StructuredOutputsParams

        return {"structured_outputs": StructuredOutputsParams(grammar=grammar)}
    except ImportError:
        from vllm.sampling_params import GuidedDecodingParams

        return {"guided_decoding": GuidedDecodingParams(grammar=grammar, backend="guidance")}
