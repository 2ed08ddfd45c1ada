"""Constrained decoding of a forced tool call: llguidance masks the logits before each sample, so
the call's arguments always parse and fit the tool's JSON schema.

llguidance (Microsoft's, behind vLLM's and llama.cpp's structured output) computes each step's
mask from the grammar lazily, on the CPU, in tens of microseconds: there is no per-schema index
to build ahead, which suits tools that arrive with each session. The mask is applied in place: on
the CPU through numpy (no compile at all), on a GPU with llguidance's torch kernel, compiled once
for its one shape at warm-up (:func:`warm_gpu_kernel`). The mask goes to the device as a copy;
nothing comes back, so the constraint adds no host sync to a step (the step's one sync remains
reading the sampled token, which the matcher then consumes).
"""
from __future__ import annotations

from collections import OrderedDict

import llguidance
import llguidance.numpy as llg_numpy
import numpy as np


# Tighter than llguidance's defaults (250,000 lexer states, 500,000 grammar symbols, 1,000,000 of
# initial lexer fuel): a session's tools (at most 32,000 characters, pipeline/conversation/agent.py) compile far
# within these, and a grammar past them fails in milliseconds instead of holding the LLM's thread.
LIMITS = llguidance.LLParserLimits(max_lexer_states=20_000, max_grammar_size=50_000, initial_lexer_fuel=200_000,
                                   step_lexer_fuel=100_000, step_max_items=20_000)
TEMPLATES = 32  # compiled grammars kept (a session's tools are the same every turn)
_templates: OrderedDict[tuple["llguidance.LLTokenizer", str], "llguidance.LLMatcher"] = OrderedDict()


def matcher_for(tokenizer: "llguidance.LLTokenizer", grammar: str) -> "llguidance.LLMatcher":
    """A fresh matcher of ``grammar``: a copy of the one compiled for it before (least recently used
    of TEMPLATES go), so a session's forced calls compile their tools' grammar once."""
    key = (tokenizer, grammar)  # the tokenizer itself: its id could be another's once it is freed
    template = _templates.pop(key, None)
    if template is None:
        template = llguidance.LLMatcher(tokenizer, grammar, limits=LIMITS)
        if template.is_error():
            raise ValueError(f"tool call grammar: {template.get_error()}")
    _templates[key] = template
    while len(_templates) > TEMPLATES:
        _templates.popitem(last=False)
    return template.deep_copy()


class CallConstraint:
    """One stream's grammar state: :meth:`mask` before sampling, :meth:`accept` after.

    The grammar makes every *finished* call valid; it cannot make a call finish. A number may have
    as many digits as a model likes, a string without ``maxLength`` as many characters, and a call
    cut off by its token budget is no call at all. So once a call has taken ``wind_down_after``
    tokens, where the grammar allows a token that only closes something (``closers``: ``}``, ``]``,
    ``"``), only those are allowed: a runaway value ends, and the call with it, still valid."""

    def __init__(self, tokenizer: "llguidance.LLTokenizer", grammar: str, closers: np.ndarray | None = None,
                 wind_down_after: int | None = None):
        self.matcher = matcher_for(tokenizer, grammar)
        self._bitmask = llg_numpy.allocate_token_bitmask(1, tokenizer.vocab_size)
        self._closers, self._wind_down_after = closers, wind_down_after
        self.steps = 0  # tokens accepted so far

    @property
    def finished(self) -> bool:
        """The grammar is complete: the call has been written."""
        return self.matcher.is_stopped()

    def mask(self, logits) -> None:
        """Tokens the grammar does not allow next get -inf (``logits``: the step's [vocab] tensor)."""
        llg_numpy.fill_next_token_bitmask(self.matcher, self._bitmask)
        if self._closers is not None and self._wind_down_after is not None and self.steps >= self._wind_down_after:
            closing = self._bitmask & self._closers
            if closing.any():
                self._bitmask[:] = closing
        if logits.device.type == "cpu":
            llg_numpy.apply_token_bitmask_inplace(logits.numpy()[None], self._bitmask)
        else:
            import torch
            import llguidance.torch as llg_torch

            mask = torch.from_numpy(self._bitmask).to(logits.device, non_blocking=True)
            llg_torch.apply_token_bitmask_inplace(logits[None], mask)

    def accept(self, token_id: int) -> None:
        self.steps += 1
        if not self.matcher.consume_token(token_id):
            raise RuntimeError(f"the sampled token {token_id} broke the tool call grammar: {self.matcher.get_error()}")


def closing_tokens(hf_tokenizer, vocab_size: int) -> np.ndarray:
    """The bitmask (llguidance's layout) of the tokens whose text only closes JSON values: ``}``,
    ``]`` and ``"``, with whitespace (one pass over the vocabulary: build it once)."""
    mask = llg_numpy.allocate_token_bitmask(1, vocab_size)
    mask[:] = 0
    bits = mask.view(np.uint32)
    for token_id in range(min(len(hf_tokenizer), vocab_size)):
        text = hf_tokenizer.decode([token_id]).strip()
        if text and set(text) <= set('}]"'):
            bits[0, token_id // 32] |= np.uint32(1 << (token_id % 32))
    return mask


def tokenizer_for(hf_tokenizer, vocab_size: int) -> "llguidance.LLTokenizer":
    """llguidance's view of a Hugging Face fast tokenizer (~1 s for a real vocabulary: build it once),
    sized to the model's logits."""
    import llguidance.hf

    return llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=vocab_size)


def warm_gpu_kernel(device, vocab_size: int) -> None:
    """Compile llguidance's mask kernel for this engine's one logits shape before serving (GPU only)."""
    import torch
    import llguidance.torch as llg_torch

    logits = torch.zeros(1, vocab_size, device=device)
    mask = torch.full(llg_torch.get_bitmask_shape(1, vocab_size), -1, dtype=torch.int32, device=device)
    llg_torch.apply_token_bitmask_inplace(logits, mask)
