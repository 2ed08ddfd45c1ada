"""Settings of the streaming speech recogniser."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

# Chunk choices of a cache-aware FastConformer ([left, lookahead] encoder frames of 80 ms):
# [70,13] = 1.12 s per step, [70,6] = 0.56 s, [70,1] = 0.16 s, [70,0] = 0.08 s.
LOOKAHEADS = ([70, 13], [70, 6], [70, 1], [70, 0])


@dataclass
class STTConfig:
    # "tiny" (random weights, built in code) | "full" (random weights at the nemotron-0.6b shape:
    # GPU timing without a checkpoint) | "real" (a pretrained .nemo)
    profile: str = "tiny"
    model: Optional[str] = None  # HF id or .nemo path (real); None = profile default
    # tiny and full: build the multilingual, language-prompted architecture (nemotron-3.5-asr-streaming);
    # real: the multilingual checkpoint is the default model (a checkpoint says itself whether it is)
    multilingual: bool = False
    # the language codes sessions may choose (checked against the model at start-up); None: the model's
    # (English: "en"; the tiny multilingual: its dictionary's). Required with the real multilingual
    # checkpoint: the codes of its prompt_dictionary you serve (the server refuses to start on one it lacks).
    languages: Optional[list[str]] = None
    # [left, lookahead] encoder frames; a model trained with another left context keeps this lookahead
    att_context_size: list[int] = field(default_factory=lambda: [70, 13])
    num_slots: int = 8
    endpoint_ms: Optional[int] = 800  # trailing blank run that ends an utterance; None disables
    device: str = "cpu"
    dtype: str = "float32"  # weights and activations: "float32" | "bfloat16" (GPU); features stay float32
    compile: bool = False  # torch.compile the encoder layers (one graph per batch width, all made by warmup())
    compile_backend: str = "inductor"  # "aot_eager"/"eager" trace and guard the same way, without codegen (tests)
    # After warm-up (with compile): "eager_on_recompile" (serve: a shape warm-up missed runs eagerly,
    # never compiles, never raises), "fail_on_recompile" (tests: raise), or "default" (leave torch's stance).
    stance_after_warmup: str = "eager_on_recompile"
    blank_bias: Optional[float] = None  # added to the blank logit; None = calibrated (tiny) / 0 (real)
    unrolled_lstm: bool = True  # prediction-net step with torch.lstm_cell instead of nn.LSTM
    # greedy RNNT over a chunk: "label_loop" (an iteration per emitted label, the joint on all frames
    # at once) or "frame_loop" (an iteration per frame or label, the joint on one frame); same tokens
    decoder: str = "label_loop"
    # self-attention caches the keys/values of the last 70 frames (projected once) instead of NeMo's
    # cached inputs (re-projected every step); falls back to NeMo's layers where unsupported
    kv_cache: bool = True
    # causal dw_striding subsampling as unfold + matmuls in channels-last (pipeline/stt/subsampling.py)
    fast_subsampling: bool = True
    # "exact": features and first chunk as an offline pass (tokens equal offline_tokens);
    # "nemo": chunking of NeMo's CacheAwareRNNTPipeline (1-hop audio look-back per chunk, every chunk
    # full-size after a silent mel pre-encode cache) - same tokens as that pipeline (benchmarks)
    framing: str = "exact"
    seed: int = 0  # tiny weights
    cache_dir: Optional[str] = None  # tiny tokenizer; None = ~/.cache/gapless/stt-tiny

    REAL_MODEL = "nvidia/nemotron-speech-streaming-en-0.6b"
    REAL_MULTILINGUAL_MODEL = "nvidia/nemotron-3.5-asr-streaming-0.6b"

    @classmethod
    def tiny(cls, **kw) -> "STTConfig":
        return cls(profile="tiny", **kw)

    @classmethod
    def full(cls, **kw) -> "STTConfig":
        kw.setdefault("device", "cuda")
        kw.setdefault("dtype", "bfloat16")
        return cls(profile="full", **kw)

    @classmethod
    def real(cls, **kw) -> "STTConfig":
        return cls(profile="real", **kw)

    def heard(self) -> tuple[str, ...]:
        """The language codes a session may ask this recogniser for (known before it loads)."""
        from pipeline.stt.languages import ENGLISH_ONLY, TINY_PROMPTS

        if self.languages is not None:
            return tuple(self.languages)
        return tuple(sorted(TINY_PROMPTS)) if self.multilingual else (ENGLISH_ONLY,)

    def __post_init__(self) -> None:
        if self.profile not in ("tiny", "full", "real"):
            raise ValueError(f"STTConfig.profile must be 'tiny', 'full' or 'real', got {self.profile!r}")
        if self.profile == "real" and self.model is None:
            self.model = self.REAL_MULTILINGUAL_MODEL if self.multilingual else self.REAL_MODEL
        if self.framing not in ("exact", "nemo"):
            raise ValueError(f"STTConfig.framing must be 'exact' or 'nemo', got {self.framing!r}")
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"STTConfig.dtype must be 'float32', 'bfloat16' or 'float16', got {self.dtype!r}")
        if self.decoder not in ("label_loop", "frame_loop"):
            raise ValueError(f"STTConfig.decoder must be 'label_loop' or 'frame_loop', got {self.decoder!r}")
        self.att_context_size = [int(x) for x in self.att_context_size]
        if self.languages is not None and (not isinstance(self.languages, (list, tuple)) or not self.languages
                                           or not all(isinstance(c, str) and c for c in self.languages)):
            raise ValueError(f"STTConfig.languages must be a non-empty list of language codes, got {self.languages!r}")
        if self.profile == "real" and self.multilingual and self.languages is None:
            raise ValueError("STTConfig: the real multilingual recogniser needs languages: the codes of its "
                             "prompt_dictionary sessions may choose, e.g. [auto, en, fr, de, es] (docs/stt.md, \"Languages\")")
        if self.num_slots < 1:
            raise ValueError("STTConfig.num_slots must be >= 1")
