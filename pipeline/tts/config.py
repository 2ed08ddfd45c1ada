"""Settings of the streaming TTS engine (CSM frames -> Mimi streaming decode -> int16 PCM)."""
from __future__ import annotations

from dataclasses import dataclass, field

from pipeline.tts.prompt import USER_SPEAKER

# What OpenAI Realtime clients ask for (the Agents SDK sends "ash" unless told): each speaks with the
# "default" voice unless voice_aliases says otherwise, so such a client starts without an error.
OPENAI_VOICES = ("alloy", "ash", "ballad", "coral", "echo", "sage", "shimmer", "verse", "marin", "cedar")

# CSM-1B was trained on English; a voice says otherwise with its own `languages`.
CSM_LANGUAGES = ("en",)
# The DSM's default voice: a kyutai/tts-voices embedding (the one Kyutai's examples use).
DSM_DEFAULT_VOICE = "expresso/ex03-ex01_happy_001_channel1_334s.wav"

@dataclass
class TTSConfig:
    """What to load and how to generate.

    ``profile="tiny"`` builds a small CSM and a small Mimi in code with random weights from
    ``seed`` (no download; same code paths as the real models). ``profile="real"`` loads
    ``csm`` (transformers-format CSM-1B) and ``mimi`` (Kyutai's Mimi checkpoint) from disk.
    """

    profile: str = "tiny"  # "tiny" | "real" | "full" (CSM-1B + Mimi shapes, random weights)
    # The voice family: "csm" (Sesame CSM-1B: a clause at a time, with the conversation as context) or
    # "dsm" (Kyutai's delayed-streams TTS, English and French: pipeline/tts/dsm/; tiny and real profiles)
    family: str = "csm"
    dsm: str = "kyutai/tts-1.6b-en_fr"  # the DSM checkpoint (real profile)
    dsm_cfg_coef: float = 2.0  # the DSM's distilled classifier-free guidance (1.0 to 4.0 by 0.5)
    dsm_padding_between: int = 1  # DSM: pad steps forced between words (clearer articulation)
    csm: str = "sesame/csm-1b"
    mimi: str = "kyutai/moshiko-pytorch-bf16"
    tokenizer: str | None = None  # real profile: defaults to ``csm`` (CSM ships the Llama-3.2 tokenizer)
    device: str = "cpu"
    dtype: str = "float32"  # CSM weights/activations; Mimi always runs in float32
    max_seq_len: int = 2048  # static KV cache length of the backbone (prompt + generated frames)
    max_frames: int = 250  # frames per utterance at most (12.5 Hz: 250 frames = 20 s)
    frames_per_word: float = 6.0  # text-length bound on frames (see TTSEngine.max_frames_for)
    min_frames: int = 6
    first_chunk_frames: int = 1  # first audio chunk after this many frames (80 ms)
    chunk_frames: int = 3  # then one chunk every this many frames
    temperature: float = 0.9  # <= 0: greedy
    top_k: int = 50
    speaker: int = 0  # the CSM speaker id of the "default" voice
    # Named voices (docs/agents.md): name -> {speaker: CSM speaker id (default 0), clip: a WAV file
    # (16-bit, any rate; relative paths from the project root), text: the clip's transcript}. The clip
    # is encoded once at start-up (bucketed: no new shape) and kept as the voice's context. "default"
    # always exists (speaker above, no clip) unless defined here.
    voices: dict[str, dict] = field(default_factory=dict)
    # Other names a session may use for a voice (alias -> voice). None: OpenAI's voice names -> "default".
    voice_aliases: dict[str, str] | None = None
    seed: int = 0  # tiny weights; and the first stream seed (each new stream takes the next one)
    # -- many streams at once -------------------------------------------------------------------
    # Streams generate together in one batched frame step, one cache row (slot) each. A stream
    # that finds every slot taken waits (FIFO) for one; at most max_waiting wait.
    num_slots: int = 8
    # The frame step runs cache rows 0..W-1, W the smallest of these covering the highest busy row
    # (a new stream takes the lowest free row). None: powers of two up to num_slots, and num_slots.
    batch_widths: tuple[int, ...] | None = None
    max_waiting: int = 64
    # -- stall-free serving (see docs/stall.md) -------------------------------------------------
    # torch.compile the per-frame step (one graph per batch width: static KV cache, positions as
    # tensors), every prefill bucket and every Mimi encode bucket. warmup() then runs each of these shapes once.
    compile: bool = False
    compile_backend: str = "inductor"  # "aot_eager"/"eager" trace and guard the same way, without codegen
    compile_mode: str | None = None  # None: "reduce-overhead" (CUDA graphs) on CUDA, inductor's default on CPU
    # Which of them compile: "frame" (the step), "prefill", "encode". On a CPU the frame step alone
    # is where compiling pays (2.1x the eager step, ~110 s of compile per batch width: docs/concurrency.md).
    compile_fns: tuple[str, ...] = ("frame", "prefill", "encode")
    # CUDA only: replay the frame step from one CUDA graph per batch width, captured at warm-up, no
    # compile (pipeline/tts/cuda_graphs.py; the step is launch-bound: docs/gpu.md). Not with compile.
    frame_graphs: bool = False
    # Prompt lengths are padded (at the end, causally masked) up to one of these row counts; the
    # largest is capped at max_seq_len. None: powers of two from 64 to max_seq_len.
    prefill_buckets: tuple[int, ...] | None = None
    max_prompt_rows: int | None = None  # context budget (rows); None: max_seq_len - max_frames
    # User audio is padded (at the end: Mimi is causal) up to one of these lengths in 80 ms frames;
    # longer audio is encoded in streaming mode in pieces of the largest bucket.
    encode_buckets: tuple[int, ...] = (25, 50, 100, 200)  # 2, 4, 8, 16 s
    # After warm-up: "eager_on_recompile" (serve: an unseen shape runs eagerly, never compiles,
    # never raises), "fail_on_recompile" (tests: raise), or "default" (leave torch's stance).
    stance_after_warmup: str = "eager_on_recompile"
    cudnn_benchmark: bool = False  # CUDA only; see docs/stall.md for why off is the safe default
    slow_step_ms: float = 200.0  # log a warning for any frame step / prefill / encode slower than this

    def __post_init__(self) -> None:
        if self.profile not in ("tiny", "full", "real"):
            raise ValueError(f"TTSConfig.profile must be 'tiny', 'full' or 'real', got {self.profile!r}")
        unknown = set(self.compile_fns) - {"frame", "prefill", "encode"}
        if unknown:
            raise ValueError(f"TTSConfig.compile_fns: unknown {sorted(unknown)} (frame, prefill, encode)")
        if self.frame_graphs and not str(self.device).startswith("cuda"):
            raise ValueError(f"TTSConfig.frame_graphs needs a CUDA device, got device={self.device!r}")
        if self.frame_graphs and self.compile:
            raise ValueError("TTSConfig: frame_graphs and compile both capture the frame step; choose one "
                             "(compile on CUDA already replays CUDA graphs)")
        if self.family not in ("csm", "dsm"):
            raise ValueError(f"TTSConfig.family must be 'csm' or 'dsm', got {self.family!r}")
        if self.dsm_cfg_coef not in (1.0, 1.5, 2.0, 2.5, 3.0, 3.5, 4.0):
            raise ValueError(f"TTSConfig.dsm_cfg_coef must be 1.0 to 4.0 in steps of 0.5, got {self.dsm_cfg_coef!r}")
        if isinstance(self.dsm_padding_between, bool) or not isinstance(self.dsm_padding_between, int) \
                or not 0 <= self.dsm_padding_between <= 8:
            raise ValueError(f"TTSConfig.dsm_padding_between must be an integer 0..8, got {self.dsm_padding_between!r}")
        if self.family == "dsm" and self.profile == "full":
            raise ValueError("TTSConfig: the dsm family has tiny and real profiles (no full)")
        keys = ("speaker", "clip", "text", "languages") if self.family == "csm" else ("voice", "languages")
        for name, spec in self.voice_specs().items():
            unknown = set(spec) - set(keys)
            if unknown:
                raise ValueError(f"voice {name!r}: unknown keys {sorted(unknown)} of a {self.family} voice {keys}")
            langs = spec.get("languages", self.family_languages())
            if not isinstance(langs, (list, tuple)) or not langs or not all(isinstance(c, str) and c for c in langs):
                raise ValueError(f"voice {name!r}: languages must be a non-empty list of codes, got {langs!r}")
            if self.family == "dsm":
                if not isinstance(spec.get("voice"), str) or not spec["voice"]:
                    raise ValueError(f"voice {name!r}: a dsm voice names its embedding (voice: a kyutai/tts-voices "
                                     f"name or a .safetensors path)")
                continue
            speaker = spec.get("speaker", 0)
            if isinstance(speaker, bool) or not isinstance(speaker, int) or speaker < 0 or speaker == USER_SPEAKER:
                raise ValueError(f"voice {name!r}: speaker must be a CSM speaker id >= 0 other than "
                                 f"{USER_SPEAKER} (the user's side of the context), got {speaker!r}")
            if spec.get("clip") is not None and not (isinstance(spec.get("text"), str) and spec["text"].strip()):
                raise ValueError(f"voice {name!r}: a clip needs its transcript (text)")
        for alias, target in self.aliases().items():
            if target not in self.voice_specs():
                raise ValueError(f"voice alias {alias!r} names no voice ({target!r}); voices: {sorted(self.voice_specs())}")

    def family_languages(self) -> tuple[str, ...]:
        """What the family's model speaks: a voice speaks these unless it says otherwise."""
        from pipeline.tts.dsm.model import DSM_LANGUAGES

        return CSM_LANGUAGES if self.family == "csm" else DSM_LANGUAGES

    def voice_specs(self) -> dict[str, dict]:
        """Every voice by name, "default" included."""
        default = {"speaker": self.speaker} if self.family == "csm" else {"voice": DSM_DEFAULT_VOICE}
        return {"default": default, **{k: dict(v or {}) for k, v in self.voices.items()}}

    def aliases(self) -> dict[str, str]:
        if self.voice_aliases is not None:
            return dict(self.voice_aliases)
        return {name: "default" for name in OPENAI_VOICES if name not in self.voices}

    def voice_languages(self) -> dict[str, tuple[str, ...]]:
        """The languages each voice a session may name speaks (an alias: its voice's); unset: CSM's English."""
        specs = self.voice_specs()
        own = {name: tuple(spec.get("languages", self.family_languages())) for name, spec in specs.items()}
        return {**own, **{alias: own[target] for alias, target in self.aliases().items()}}

    def voice_names(self) -> tuple[str, ...]:
        """What a session may name as its voice."""
        return tuple(sorted({*self.voice_specs(), *self.aliases()}))

    @classmethod
    def tiny(cls, **overrides) -> "TTSConfig":
        """Small random-weight models: faster than real time on one CPU thread."""
        base = dict(profile="tiny", max_seq_len=512, max_frames=100, device="cpu", dtype="float32",
                    encode_buckets=(25, 50, 100))
        base.update(overrides)
        return cls(**base)

    @classmethod
    def full(cls, **overrides) -> "TTSConfig":
        """Full-size CSM-1B + Mimi with random weights (benchmarks on a GPU; no checkpoint needed)."""
        base = dict(profile="full", max_seq_len=2048, max_frames=250, device="cuda", dtype="bfloat16",
                    num_slots=32)
        base.update(overrides)
        return cls(**base)

    @classmethod
    def real(cls, **overrides) -> "TTSConfig":
        """Sesame CSM-1B + Kyutai Mimi from local checkpoints (a GPU is needed for real time)."""
        base = dict(profile="real", max_seq_len=2048, max_frames=250, device="cuda", dtype="bfloat16",
                    num_slots=32)
        base.update(overrides)
        return cls(**base)
