"""Text tokenizers: the real checkpoint's tokenizer, or a tiny one trained here in code.

The tiny profile needs a tokenizer without a download. We train a byte-level BPE
(the same family as Llama-3's tokenizer) on a small embedded English corpus in a few
milliseconds, wrap it as a ``PreTrainedTokenizerFast`` and give it a Llama-3 style chat
template, so that the LLM and TTS engines run exactly the code paths they run with a
real tokenizer (``apply_chat_template``, ``encode``, ``decode``).
"""
from __future__ import annotations

import functools

from pipeline.runtime.weights import require_pretrained

_CORPUS = """
Hello, how are you today? I am fine, thank you. What can I do for you?
The weather is nice and the sun is out. Let us go for a walk in the park.
Voice assistants listen, think and speak. A good reply is short and clear.
Numbers like 1, 2, 3, 10, 42 and 2026 appear in speech. Dr. Smith met Mr. Jones at 5 p.m.
Could you tell me the time, please? Sure, it is half past nine in the morning.
I would like to book a table for two people tomorrow evening at seven.
The quick brown fox jumps over the lazy dog. She sells sea shells by the sea shore.
Streaming speech recognition turns audio into text while the person is still talking.
Thanks a lot! You're welcome. Goodbye, and have a great day.
"""

SPECIAL_TOKENS = [
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
    "<|pad|>",
]

# Llama-3's turn format; tools (when given) and tool calls in the Hermes / Qwen2.5 format, as the
# real checkpoint's template writes them (pipeline/llm/tool_calls.py parses them back).
LLAMA3_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% if tools %}<|start_header_id|>system<|end_header_id|>\n\n# Tools\n<tools>\n"
    "{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}</tools>\n"
    "To call a function, write <tool_call>\n{\"name\": <name>, \"arguments\": <arguments>}\n</tool_call><|eot_id|>"
    "{% endif %}"
    "{% for message in messages %}"
    "<|start_header_id|>{{ message['role'] }}<|end_header_id|>\n\n"
    "{{ (message['content'] or '') | trim }}"
    "{% for call in message['tool_calls'] or [] %}<tool_call>\n"
    "{{ {'name': call['function']['name'], 'arguments': call['function']['arguments']} | tojson }}\n</tool_call>"
    "{% endfor %}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)


@functools.lru_cache(maxsize=4)
def tiny_tokenizer(vocab_size: int = 512):
    """A byte-level BPE tokenizer with Llama-3 special tokens, trained in code (deterministic)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([line for line in _CORPUS.splitlines() if line], trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|begin_of_text|>",
        eos_token="<|eot_id|>",
        pad_token="<|pad|>",
    )
    fast.chat_template = LLAMA3_CHAT_TEMPLATE
    return fast


def load_tokenizer(name_or_path: str):
    """Load a real tokenizer (Hugging Face id or local directory), failing clearly when absent."""
    from transformers import AutoTokenizer

    path = require_pretrained(name_or_path, what="tokenizer")
    return AutoTokenizer.from_pretrained(path)
