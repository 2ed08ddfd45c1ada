"""The in-process LLM backend: a gpt-fast style decode loop over a transformers causal LM.

Design
------
* One prefill over the whole prompt, then one-token decode steps against a per-stream
  :class:`transformers.StaticCache` (preallocated, fixed shapes; pooled and reused across
  streams, so steady state allocates no KV memory).
* Sampling stays on the device (temperature, top-k, top-p, with a per-stream
  ``torch.Generator``); greedy (argmax) when the temperature is 0. Only the chosen token id
  comes back to the host, once per step (needed for EOS and detokenization anyway).
* :meth:`LLMEngine.stream` returns an :class:`LLMStream` iterator that yields text deltas.
  Each ``next()`` runs as many model steps as it takes to produce new printable text, so a
  caller can interleave several streams on ONE inference thread, one delta at a time. Every
  stream owns its cache, sampler state and detokenizer state; the model itself is shared
  and stateless.
* ``LLMStream.close()`` cancels a stream and returns its cache to the pool;
  :attr:`LLMEngine.active_requests` counts streams that are neither finished nor closed.
  Whoever abandons a stream must close it, on the inference thread (``InferenceThread.iterate``
  does): there is no ``__del__``, which would free the cache on whatever thread the garbage
  collector happens to run, racing the inference thread that may be using the pool.

The concatenation of a stream's deltas equals ``tokenizer.decode(generated_ids,
skip_special_tokens=True)``: every step decodes all generated ids and emits the new suffix,
holding back trailing U+FFFD (an incomplete multi-byte character whose remaining bytes are
in the next token).
"""
from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING, Any, Callable, Iterator

from pipeline.engines import Sampling
from pipeline.llm.config import LLMConfig

if TYPE_CHECKING:  # pragma: no cover
    import torch

log = logging.getLogger(__name__)

Message = dict[str, Any]

# End-of-turn tokens of common chat models; whichever exist in a tokenizer's vocab stop a stream.
_KNOWN_STOP_TOKENS = (
    "<|eot_id|>",
    "<|end_of_text|>",
    "<|im_end|>",
    "<|endoftext|>",
    "<|eom_id|>",
    "<end_of_turn>",
    "</s>",
)

_REPLACEMENT_CHAR = "\ufffd"


# --------------------------------------------------------------------------------------------
# prompt building


def approx_token_count(messages: list[Message]) -> int:
    """A tokenizer-free estimate of a templated prompt's length (about 4 characters a token)."""
    return 2 + sum(4 + (len(str(m.get("content") or "")) + 3) // 4 for m in messages)


def build_prompt(
    history: list[Message],
    system_prompt: str | None,
    budget: int,
    *,
    count_tokens: Callable[[list[Message]], int] | None = None,
) -> list[Message]:
    """The messages to send: system prompt first, then as many of the latest turns as fit.

    ``history`` is the conversation (``{"role", "content"}`` dicts, oldest first). A system
    message at the start of ``history`` overrides ``system_prompt``; other system messages are
    dropped. The oldest turns are removed until ``count_tokens(messages) <= budget``, but the
    system prompt and the latest user turn (with anything after it) are always kept, even if
    they alone exceed the budget (the caller truncates further if it must). After trimming the
    kept history starts with a user turn (templates that require user/assistant alternation
    stay valid). ``count_tokens`` defaults to :func:`approx_token_count`; the engine passes
    the exact length of the chat-templated prompt.

    ``count_tokens`` runs O(log n) times for n turns, never once per dropped turn: a prompt's
    length does not grow as older turns leave it, so the first start that fits is found by a
    search that gallops back from the latest user turn (1, 2, 4, ... starts), then bisects.
    So each prompt it counts holds at most about twice the kept turns: the cost follows what
    is kept, not how long the history has grown.
    """
    # Over 40 lines as one function: the chat template and its trimming to one token budget.
    count = count_tokens or approx_token_count
    system = system_prompt or None
    if history and history[0].get("role") == "system":
        system = history[0].get("content") or system
    turns = [dict(m) for m in history if m.get("role") != "system"]
    head = [{"role": "system", "content": system}] if system else []

    user_idx = [i for i, m in enumerate(turns) if m.get("role") == "user"]
    last_user = user_idx[-1] if user_idx else max(len(turns) - 1, 0)
    # Where the kept history may start, oldest first: the whole history, or a user turn before the
    # latest (which is kept whatever the budget says).
    starts = [s for s in [0] + [i for i in user_idx if i > 0] if s < last_user]

    def fits(k: int) -> bool:
        return count(head + turns[starts[k]:]) <= budget

    # The first k with fits(k) (len(starts): none, so the latest user turn alone). fits only turns
    # true as k grows: gallop back from the newest start until one does not fit, then bisect.
    lo, hi, step = 0, len(starts), 1  # the answer is in [lo, hi]
    while hi > lo:
        k = max(hi - step, lo)
        if not fits(k):
            lo = k + 1
            break
        hi, step = k, step * 2
    while lo < hi:
        k = (lo + hi) // 2
        if fits(k):
            hi = k
        else:
            lo = k + 1
    start = starts[lo] if lo < len(starts) else last_user
    return head + turns[start:]


# A tool for warm-up: a forced call builds the grammar's tokenizer (and on a GPU its mask kernel).
WARMUP_TOOL = {"type": "function", "name": "ping", "description": "Warm-up.",
               "parameters": {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}}


# --------------------------------------------------------------------------------------------
# sampling


def sample_next(
    logits: "torch.Tensor",
    temperature: float,
    top_k: int,
    top_p: float,
    generator: "torch.Generator | None" = None,
) -> "torch.Tensor":
    """Pick the next token id from ``logits`` (shape ``[vocab]``) on its device; returns ``[1]``.

    Greedy when ``temperature <= 0``; else temperature, then top-k (``top_k <= 0``: off), then
    top-p (nucleus, ``top_p >= 1``: off) filtering and one multinomial draw.
    """
    import torch

    if temperature <= 0:
        return torch.argmax(logits, dim=-1, keepdim=True)
    logits = logits.float() / temperature
    vocab = logits.shape[-1]
    if 0 < top_k < vocab:
        vals, idx = torch.topk(logits, top_k)  # sorted, descending
    else:
        vals, idx = torch.sort(logits, descending=True)
    if top_p < 1.0:
        probs = torch.softmax(vals, dim=-1)
        cum = torch.cumsum(probs, dim=-1)
        # Drop a token when the tokens before it already cover top_p (the first always stays).
        vals = vals.masked_fill(cum - probs > top_p, float("-inf"))
    probs = torch.softmax(vals, dim=-1)
    choice = torch.multinomial(probs, 1, generator=generator)
    return idx.gather(-1, choice)


# --------------------------------------------------------------------------------------------
# model loading


def _resolve_device(device: str) -> str:
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def _resolve_dtype(dtype: str, device: str) -> "torch.dtype":
    import torch

    if dtype == "auto":
        return torch.bfloat16 if device.startswith("cuda") else torch.float32
    table = {
        "float32": torch.float32, "fp32": torch.float32,
        "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
        "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    }
    if dtype not in table:
        raise ValueError(f"unknown dtype {dtype!r}; expected one of {sorted(table)} or 'auto'")
    return table[dtype]


def _tiny_output_bias(tokenizer) -> Any:
    import torch

    bias = torch.zeros(len(tokenizer))
    special = set(tokenizer.all_special_ids)
    for tid in range(len(tokenizer)):
        if tid in special:
            continue
        piece = tokenizer.decode([tid])
        if "\ufffd" in piece or not piece.isprintable() or not piece.strip():
            bias[tid] = -30.0
        elif piece in (".", ",", "?", "!"):
            bias[tid] = 4.0
        elif piece.startswith(" ") and piece[1:].isalpha():
            bias[tid] = 3.0
    return bias


def build_tiny_model(cfg: LLMConfig, tokenizer) -> Any:
    """A small random ``LlamaForCausalLM`` over the tiny tokenizer (fixed seed -> same weights)."""
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    mcfg = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=cfg.tiny_hidden,
        intermediate_size=cfg.tiny_intermediate or cfg.tiny_hidden * 2,
        num_hidden_layers=cfg.tiny_layers,
        num_attention_heads=cfg.tiny_heads,
        num_key_value_heads=cfg.tiny_kv_heads,
        max_position_embeddings=max(cfg.max_context_tokens, 256),
        initializer_range=0.1,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.seed)
        model = LlamaForCausalLM(mcfg)
    # Calibration, like the blank bias of the tiny STT joint: random weights pick byte fragments
    # and almost never a space or a full stop, so a reply would have no words or clauses for the
    # TTS handoff. A bias on the output layer favours whole-word tokens and clause punctuation and
    # rules out invalid UTF-8 fragments and control characters. Part of the model, so transformers'
    # own generate (the reference in tests) sees it too.
    head = torch.nn.Linear(cfg.tiny_hidden, len(tokenizer), bias=True)
    with torch.no_grad():
        head.weight.copy_(model.lm_head.weight)
        head.bias.copy_(_tiny_output_bias(tokenizer))
    model.lm_head = head
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    return model


# --------------------------------------------------------------------------------------------
# engine


class LLMEngine:
    """Streaming, cancellable text generation with a transformers causal LM (batch 1 per stream)."""

    def __init__(self, cfg: LLMConfig):
        import torch

        self.cfg = cfg
        self.device = torch.device(_resolve_device(cfg.device))
        self.dtype = _resolve_dtype(cfg.dtype, self.device.type)
        if cfg.profile in ("tiny", "full"):  # random weights built in code (full: at the real shape)
            from pipeline.runtime.tokenizer import tiny_tokenizer

            self.tokenizer = tiny_tokenizer()
            model = build_tiny_model(cfg, self.tokenizer)
        else:
            from transformers import AutoModelForCausalLM

            from pipeline.runtime.tokenizer import load_tokenizer
            from pipeline.runtime.weights import require_pretrained

            path = require_pretrained(
                cfg.model,
                what="LLM",
                allow_patterns=["*.json", "*.safetensors", "*.txt", "*.model", "*.tiktoken", "*.jinja"],
            )
            self.tokenizer = load_tokenizer(path)
            model = AutoModelForCausalLM.from_pretrained(path, dtype=self.dtype)
        self.model = model.to(device=self.device, dtype=self.dtype).eval()
        self.model.requires_grad_(False)
        self.stop_ids: frozenset[int] = frozenset(self._find_stop_ids())
        self._cache_pool: list[Any] = []
        self._pool_limit = 4
        self._pool_lock = threading.Lock()
        self._active = 0
        self._count_lock = threading.Lock()
        self._streams_started = 0
        self._lltokenizer = None  # llguidance's tokenizer, for forced tool calls
        self._closers = None  # the tokens that only close JSON values (pipeline.llm.constraint)

    # -- public API -------------------------------------------------------------------------

    @property
    def active_requests(self) -> int:
        """Streams that are neither finished nor closed."""
        return self._active

    def warmup(self) -> None:
        """Run one short generation (prefill + decode steps), and one forced tool call (the tool-call
        grammar's tokenizer and, on a GPU, its mask kernel), on the calling (inference) thread."""
        t0 = time.perf_counter()
        for tools in (None, (WARMUP_TOOL,)):
            stream = self.stream([{"role": "user", "content": "Hello!"}],
                                 Sampling(temperature=0.0, max_output_tokens=4, tools=tools,
                                          tool_choice="required" if tools else None))
            try:
                for _ in stream:
                    pass
            finally:
                stream.close()
        if self.device.type == "cuda":
            from pipeline.llm.constraint import warm_gpu_kernel

            warm_gpu_kernel(self.device, self.vocab_size)
        log.info("LLM warm-up took %.3f s", time.perf_counter() - t0)

    @property
    def vocab_size(self) -> int:
        return int(self.model.get_output_embeddings().weight.shape[0])

    def _call_tokenizer(self):
        """llguidance's tokenizer, built once (on the inference thread: warm-up builds it)."""
        if self._lltokenizer is None:
            from pipeline.llm.constraint import closing_tokens, tokenizer_for

            self._lltokenizer = tokenizer_for(self.tokenizer, self.vocab_size)
            self._closers = closing_tokens(self.tokenizer, self.vocab_size)
        return self._lltokenizer

    def stream(
        self,
        messages: list[Message],
        sampling: Sampling = Sampling(),
        *,
        top_k: int | None = None,
        top_p: float | None = None,
        seed: int | None = None,
    ) -> "LLMStream":
        """Start generating a reply to ``messages`` (conversation, oldest first, OpenAI chat format).

        The system prompt is applied and old turns trimmed to ``cfg.history_tokens`` (see
        :func:`build_prompt`). Returns an iterator of text deltas; nothing runs on the model
        until its first ``next()``. ``sampling`` and the keyword arguments override the config per
        request. ``sampling.tools`` (OpenAI function tools) go to the chat template; the model calls
        one in its own format (``pipeline.llm.tool_calls``). ``tool_choice`` ``"required"`` or a named
        function forces a call, its arguments constrained to the tool's schema (``pipeline.llm.constraint``).
        """
        # Over 40 lines as one function: a stream's set-up in order: prompt, grammar, admission.
        cfg = self.cfg
        tools, tool_choice, temperature = sampling.tools, sampling.tool_choice, sampling.temperature
        max_new = cfg.max_output_tokens if sampling.max_output_tokens is None else int(sampling.max_output_tokens)
        constraint = None
        if tools and tool_choice is not None and tool_choice not in ("auto", "none"):
            from pipeline.llm.constraint import CallConstraint
            from pipeline.llm.tool_calls import chosen_tools, forced_call_grammar

            max_new = max(max_new, cfg.max_tool_call_tokens)  # a call cut short could not run
            constraint = CallConstraint(self._call_tokenizer(), forced_call_grammar(chosen_tools(tools, tool_choice)),
                                        self._closers, wind_down_after=max_new // 2)
        prompt_ids = self.prompt_ids(messages, max_output_tokens=max_new, tools=tools)
        max_new = min(max_new, cfg.max_context_tokens - len(prompt_ids))
        if seed is None:
            seed = cfg.seed + self._streams_started
        self._streams_started += 1
        return LLMStream(
            self,
            prompt_ids,
            max_output_tokens=max_new,
            temperature=cfg.temperature if temperature is None else float(temperature),
            top_k=cfg.top_k if top_k is None else int(top_k),
            top_p=cfg.top_p if top_p is None else float(top_p),
            seed=seed,
            constraint=constraint,
        )

    def count_prompt_tokens(self, messages: list[Message], tools: list[dict] | None = None) -> int:
        return len(self._apply_template(messages, tools))

    def prompt_ids(self, messages: list[Message], *, max_output_tokens: int | None = None,
                   tools: list[dict] | None = None) -> list[int]:
        """The token ids of the templated, trimmed prompt for ``messages`` (and ``tools``)."""
        cfg = self.cfg
        max_new = cfg.max_output_tokens if max_output_tokens is None else max_output_tokens
        hard_limit = cfg.max_context_tokens - max(1, max_new)
        if hard_limit <= 0:
            raise ValueError(
                f"max_context_tokens={cfg.max_context_tokens} leaves no room for a prompt "
                f"with max_output_tokens={max_new}"
            )
        budget = min(cfg.history_tokens, hard_limit)
        msgs = build_prompt(messages, cfg.system_prompt, budget,
                            count_tokens=lambda m: self.count_prompt_tokens(m, tools))
        ids = self._apply_template(msgs, tools)
        if len(ids) > hard_limit:
            ids = self._truncate_last_user(msgs, len(ids) - hard_limit, tools)
        if len(ids) >= cfg.max_context_tokens:
            raise ValueError(f"prompt of {len(ids)} tokens does not fit max_context_tokens={cfg.max_context_tokens}")
        return ids

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    # -- internals ----------------------------------------------------------------------------

    def _apply_template(self, messages: list[Message], tools: list[dict] | None = None) -> list[int]:
        from pipeline.llm.tool_calls import template_messages, template_tools

        out = self.tokenizer.apply_chat_template(
            template_messages(messages), tools=template_tools(tools), add_generation_prompt=True, tokenize=True,
            return_dict=False,
        )
        if isinstance(out, dict) or hasattr(out, "keys"):
            out = out["input_ids"]
        return list(out)

    def _truncate_last_user(self, msgs: list[Message], overflow: int, tools: list[dict] | None = None) -> list[int]:
        """Cut the start of the latest user message so the prompt shrinks by ``overflow`` tokens."""
        idx = max(i for i, m in enumerate(msgs) if m.get("role") == "user") if any(
            m.get("role") == "user" for m in msgs
        ) else len(msgs) - 1
        content_ids = self.tokenizer.encode(str(msgs[idx].get("content") or ""), add_special_tokens=False)
        keep = max(0, len(content_ids) - overflow - 2)  # 2 tokens of slack for re-tokenization
        msgs = list(msgs)
        msgs[idx] = dict(msgs[idx], content=self.decode(content_ids[len(content_ids) - keep:]) if keep else "")
        return self._apply_template(msgs, tools)

    def _find_stop_ids(self) -> set[int]:
        tok = self.tokenizer
        ids: set[int] = set()
        if tok.eos_token_id is not None:
            ids.add(int(tok.eos_token_id))
        gen_eos = getattr(getattr(self.model, "generation_config", None), "eos_token_id", None)
        if isinstance(gen_eos, int):
            ids.add(gen_eos)
        elif gen_eos:
            ids.update(int(i) for i in gen_eos)
        vocab = tok.get_vocab()
        for t in _KNOWN_STOP_TOKENS:
            if t in vocab:
                ids.add(int(vocab[t]))
        return ids

    def _acquire_cache(self):
        with self._pool_lock:
            if self._cache_pool:
                return self._cache_pool.pop()
        from transformers import StaticCache

        return StaticCache(config=self.model.config, max_cache_len=self.cfg.max_context_tokens)

    def _release_cache(self, cache) -> None:
        import torch

        with torch.inference_mode():  # the cache tensors were created in inference mode
            cache.reset()
        with self._pool_lock:
            if len(self._cache_pool) < self._pool_limit:
                self._cache_pool.append(cache)

    def _stream_opened(self) -> None:
        with self._count_lock:
            self._active += 1

    def _stream_closed(self) -> None:
        with self._count_lock:
            self._active -= 1

    def _forward(self, input_ids: "torch.Tensor", position_ids: "torch.Tensor", cache) -> "torch.Tensor":
        """One model call (prefill or decode step); returns the last position's logits ``[vocab]``."""
        out = self.model(
            input_ids=input_ids,
            position_ids=position_ids,
            cache=cache,
            use_cache=True,
            logits_to_keep=1,
        )
        return out.logits[0, -1]


class LLMStream(Iterator[str]):
    """One generation: an iterator of text deltas that owns its KV cache. ``close()`` cancels it."""

    def __init__(
        self,
        engine: LLMEngine,
        prompt_ids: list[int],
        *,
        max_output_tokens: int,
        temperature: float,
        top_k: int,
        top_p: float,
        seed: int,
        constraint=None,
    ):
        self.engine = engine
        self.constraint = constraint  # a forced tool call's grammar (pipeline.llm.constraint), or None
        self.prompt_ids = prompt_ids
        self.max_output_tokens = max(0, max_output_tokens)
        self.temperature = temperature
        self.top_k = top_k
        self.top_p = top_p
        self.seed = seed
        self.generated: list[int] = []
        self.finish_reason: str | None = None  # "stop" | "length" | "cancelled"
        self.emitted = ""
        self._cache = None
        self._generator = None
        self._next_token = None  # device tensor [1, 1]: the token fed to the next step
        self._pos = 0
        self._done = False
        self._lock = threading.RLock()
        engine._stream_opened()
        self.first_token_s: float | None = None  # prefill latency, seconds (set at first step)

    def __iter__(self) -> "LLMStream":
        return self

    def __next__(self) -> str:
        with self._lock:
            if self._done:
                raise StopIteration
            try:
                delta = self._advance()
            except BaseException:
                self._finish("error")
                raise
            if delta is None:
                raise StopIteration
            return delta

    def close(self) -> None:
        """Stop generating and free this stream's state (idempotent)."""
        with self._lock:
            if not self._done:
                self._finish("cancelled")

    def __enter__(self) -> "LLMStream":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def text(self) -> str:
        return self.emitted

    # -- internals ----------------------------------------------------------------------------

    def _finish(self, reason: str) -> None:
        if self._done:
            return
        self._done = True
        self.finish_reason = self.finish_reason or reason
        cache, self._cache = self._cache, None
        self._next_token = None
        self._generator = None
        if cache is not None:
            self.engine._release_cache(cache)
        self.engine._stream_closed()

    def _step(self) -> int:
        """Run one model call and return the sampled token id."""
        import torch

        eng = self.engine
        with torch.inference_mode():
            t0 = time.perf_counter()
            if self._cache is None:
                self._cache = eng._acquire_cache()
                if self.temperature > 0:
                    self._generator = torch.Generator(device=eng.device).manual_seed(int(self.seed))
                n = len(self.prompt_ids)
                ids = torch.tensor([self.prompt_ids], dtype=torch.long, device=eng.device)
                pos = torch.arange(n, device=eng.device).unsqueeze(0)
                logits = eng._forward(ids, pos, self._cache)
                self._pos = n
            else:
                pos = torch.full((1, 1), self._pos, dtype=torch.long, device=eng.device)
                logits = eng._forward(self._next_token, pos, self._cache)
                self._pos += 1
            if self.constraint is not None:
                self.constraint.mask(logits)  # the grammar's next tokens only
            tok = sample_next(logits, self.temperature, self.top_k, self.top_p, self._generator)
            self._next_token = tok.view(1, 1)
            token_id = int(tok.item())  # the one host sync per step
            if self.constraint is not None:
                self.constraint.accept(token_id)
            if self.first_token_s is None:  # prefill + first sample
                self.first_token_s = time.perf_counter() - t0
        return token_id

    def _flush(self) -> str:
        """The not yet emitted rest of the decoded text (including held-back characters)."""
        full = self.engine.decode(self.generated)
        if full.startswith(self.emitted):
            rest = full[len(self.emitted):]
        else:  # cannot happen for byte-level BPE; never re-emit text already sent
            log.warning("LLM detokenization is not prefix-stable; emitting best-effort delta")
            rest = ""
        self.emitted += rest
        return rest

    def _advance(self) -> str | None:
        """Run model steps until new printable text appears; None when the stream has ended."""
        while True:
            if len(self.generated) >= self.max_output_tokens:
                self.finish_reason = self.finish_reason or "length"
                rest = self._flush()
                self._finish("length")
                return rest or None
            token_id = self._step()
            if self.constraint is not None and self.constraint.finished:  # the forced call is written
                self.generated.append(token_id)
                self.finish_reason = "stop"
                rest = self._flush()
                self._finish("stop")
                return rest or None
            if token_id in self.engine.stop_ids:
                self.finish_reason = "stop"
                rest = self._flush()
                self._finish("stop")
                return rest or None
            self.generated.append(token_id)
            if len(self.generated) >= self.max_output_tokens:
                continue  # flushes everything (held-back bytes included) on the next pass
            full = self.engine.decode(self.generated)
            stable = full.rstrip(_REPLACEMENT_CHAR)
            if len(stable) > len(self.emitted) and stable.startswith(self.emitted):
                delta = stable[len(self.emitted):]
                self.emitted = stable
                return delta
