"""The languages a recogniser speaks, and how one is asked for.

An English-only model (nemotron-speech-streaming-en) speaks "en" and takes no prompt. A
language-prompted model (NeMo's ``EncDecRNNTBPEModelWithPrompt``, as nemotron-3.5-asr-streaming)
is told each stream's language by a one-hot prompt on its encoder output, through its
``prompt_kernel``: the model's ``prompt_dictionary`` maps language codes ("fr", "de-DE",
"auto") to prompt indices. Its vocabulary carries language tags ("<fr-FR>") that it may emit;
they are never text.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch

from pipeline.engines import match_language

# The multilingual nemotron's prompt: 128 one-hot language slots, codes at the published model's indices
# (a subset: the tiny tokenizer's four languages, and "auto", the model's own detection).
TINY_PROMPTS = {"en-US": 0, "en": 0, "es-ES": 2, "es": 3, "fr": 8, "fr-FR": 8, "de": 9, "de-DE": 9, "auto": 101}
TAG = re.compile(r"^<[a-z]{2}-[A-Z]{2}>$")  # NeMo's own pattern of a language tag (rnnt_decoding.py)
ENGLISH_ONLY = "en"


@dataclass(frozen=True)
class Languages:
    """``prompts``: language code -> prompt index (empty: an English-only model, no prompt);
    ``default``: the code a stream gets when none is asked for; ``tags``: the token ids of
    language tags, left out of every text."""

    prompts: dict[str, int] = field(default_factory=dict)
    default: str = ENGLISH_ONLY
    tags: frozenset[int] = frozenset()
    num_prompts: int = 0

    @classmethod
    def of(cls, model) -> "Languages":
        tags = _tag_ids(model.tokenizer)
        if not (getattr(model, "concat", False) and hasattr(model, "prompt_kernel")):
            return cls(tags=tags)
        prompts = {str(k): int(v) for k, v in model.cfg.model_defaults.get("prompt_dictionary", {}).items()}
        if not prompts:
            raise ValueError("the recogniser takes a language prompt but its config has no prompt_dictionary")
        default = "auto" if "auto" in prompts else next(iter(prompts))
        return cls(prompts, default, tags, int(model.num_prompts))

    @property
    def prompted(self) -> bool:
        return bool(self.prompts)

    @property
    def codes(self) -> tuple[str, ...]:
        """Every code a stream may ask for, sorted ("auto" among them where the model detects)."""
        return tuple(sorted(self.prompts)) if self.prompted else (ENGLISH_ONLY,)

    def resolve(self, language: str | None) -> str:
        """The code this model knows ``language`` by: itself, or its primary subtag ("fr-CA" ->
        "fr" where only "fr" is known); ``None``: the default. ValueError when it speaks neither."""
        if language is None:
            return self.default
        code = match_language(language, self.codes)
        if code is None:
            raise ValueError(f"the recogniser does not speak {language!r}; it speaks {list(self.codes)}")
        return code

    def check_offered(self, codes: tuple[str, ...]) -> None:
        """ValueError (at start-up) when sessions are offered a code this model does not speak."""
        unknown = []
        for code in codes:
            try:
                self.resolve(code)
            except ValueError:
                unknown.append(code)
        if unknown:
            raise ValueError(f"STTConfig.languages offers {unknown}, which this recogniser does not speak; "
                             f"it speaks {list(self.codes)}")

    def index(self, language: str | None) -> int:
        """The prompt index of ``language`` (0 for an English-only model, which takes none)."""
        code = self.resolve(language)
        return self.prompts[code] if self.prompted else 0

    def text_tokens(self, tokens: list[int], frames: list[int] | None = None):
        """``tokens`` without language tags (and their ``frames`` alike, when given)."""
        if not self.tags:
            return tokens if frames is None else (tokens, frames)
        keep = [i for i, t in enumerate(tokens) if t not in self.tags]
        kept = [tokens[i] for i in keep]
        return kept if frames is None else (kept, [frames[i] for i in keep])


def _tag_ids(tokenizer) -> frozenset[int]:
    vocab = getattr(tokenizer, "vocab", None)
    if not vocab:
        return frozenset()
    return frozenset(i for i, piece in enumerate(vocab) if isinstance(piece, str) and TAG.match(piece))


def prompted(kernel, enc_out: torch.Tensor, prompts: torch.Tensor, num_prompts: int) -> torch.Tensor:
    """Each row's language prompt on its encoder output [B, D, T], as NeMo's forward applies one:
    the one-hot of the row's prompt index (``prompts`` [B], on the device: no sync) beside every
    frame, through the model's ``prompt_kernel``. The encoder's caches never see the prompt."""
    x = enc_out.transpose(1, 2)
    onehot = torch.nn.functional.one_hot(prompts, num_prompts).to(x.dtype)[:, None, :].expand(-1, x.shape[1], -1)
    return kernel(torch.cat([x, onehot], dim=-1)).transpose(1, 2)
