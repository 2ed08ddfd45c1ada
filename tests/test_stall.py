"""No compilation after warm-up, whatever the conversation: counted, never timed (docs/stall.md).

The engine runs with ``compile=True`` (tiny models, CPU) on ``aot_eager``: it traces like inductor,
with AOTAutograd's functionalization of the KV-cache writes, but generates no code, and Dynamo's
guards and recompiles, which these tests count, do not depend on the backend. Here it takes 77 s
where inductor took 189 s (`pytest tests/test_stall.py --durations=5`, 2-core VM, 2026-12-06); no
shipped config compiles the TTS (the GPU one replays CUDA graphs), and inductor's own work is
tested by tests/test_compile_cache.py. ``GAPLESS_STALL_BACKEND=inductor`` runs these with it.
"""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from pipeline.audio_constants import CODEC_FRAME_SAMPLES
from pipeline.runtime.compile_guard import CompileCounter
from pipeline.tts.config import TTSConfig
from pipeline.tts.engine import Segment, TTSEngine

torch.set_num_threads(1)

BACKEND = os.environ.get("GAPLESS_STALL_BACKEND", "aot_eager")
# a configured voice whose clip (4.10 s, longer than the largest encode bucket here) is encoded at warm-up
ROBOT = {"speaker": 2, "clip": "voices/robot.wav", "text": "Hello. I am the robot voice, and I speak a little slowly."}
RATE_16K = 16_000


@pytest.fixture(scope="module")
def counter():
    return CompileCounter().install()


@pytest.fixture(scope="module")
def warm(counter):
    # two slots: frame-step graphs at widths 1 and 2 (inductor needs minutes per graph on 2 cores)
    cfg = TTSConfig.tiny(max_frames=12, max_seq_len=128, prefill_buckets=(64, 128), encode_buckets=(13, 25), num_slots=2,
                         compile=True, compile_backend=BACKEND, stance_after_warmup="fail_on_recompile",
                         voices={"robot": ROBOT})
    engine = TTSEngine(cfg)
    before = counter.total
    engine.warmup()
    assert counter.total > before  # the warm-up did compile: the counter sees this engine's compiles
    counter.mark_warm()
    yield engine
    torch.compiler.set_stance("default")  # the stance is process-wide: leave other tests alone


def _speech(seconds: float, seed: int) -> np.ndarray:
    from pipeline.audio import speech_like

    return speech_like(seconds, RATE_16K, seed=seed)


def test_conversation_after_warmup_compiles_nothing(warm, counter):
    engine = warm
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    # user turns of never-seen lengths (one longer than the largest encode bucket, 2 s), replies
    # of never-seen text lengths, each turn with all previous turns as context
    user_seconds = [0.37, 1.13, 2.93, 0.81, 1.71, 0.09, 4.4, 1.99, 0.55]
    # Mimi codes one frame per 80 ms of audio, the last one partly filled: ceil(seconds / 0.08 s),
    # worked out by hand (0.37 s -> 4.6 -> 5, 4.4 s -> exactly 55, ...)
    user_frames = [5, 15, 37, 11, 22, 2, 55, 25, 7]
    replies = ["Hi.", "Sure, I can do that.", "Okay.", "Let me think about it for a moment.", "Yes!",
               "That is a long one, but fine.", "Two words.", "No.", "Here is the last answer of today."]
    context: list[Segment] = []
    prompt_rows = set()
    for turn, (sec, text, frames) in enumerate(zip(user_seconds, replies, user_frames, strict=True)):
        pcm = _speech(sec, seed=turn)
        codes = engine.encoder.encode_user_audio(pcm)
        assert codes.shape == (frames, 32), (sec, codes.shape)
        context.append(Segment(speaker=1, text=f"user turn {turn}", codes=codes))
        s = engine.stream(text, context=context)
        prompt_rows.add(len(s.prompt_tokens))
        chunks = list(s)
        assert sum(len(c) for c in chunks) == s.frames * CODEC_FRAME_SAMPLES > 0
        context.append(Segment(speaker=0, text=text, codes=s.codes))  # the generated codes, not re-encoded
    assert len(prompt_rows) >= 6  # the prompts really had different lengths...
    assert {engine.bucket_for(r) for r in prompt_rows} == set(engine.prefill_buckets)  # ...in every bucket
    assert counter.after_warmup == 0
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs
    assert engine.stats()["unseen_shape_calls"] == 0


def test_voices_and_session_clips_compile_nothing(warm, counter):
    """A configured voice's clip (encoded at warm-up) and a session's own clips at lengths never
    seen (24 kHz, as the Realtime endpoint and v1's voice.clip carry them) lead prompts with
    nothing compiled and no unseen shape."""
    engine = warm
    compiles, unseen = counter.after_warmup, engine.stats()["unseen_shape_calls"]
    robot = engine.voices.voice("robot")
    assert robot.speaker == 2 and robot.reference.codes.shape == (52, 32)  # 98 437 samples / 1920 -> 52 (by hand)
    assert engine.voices.voice("alloy") == engine.voices.voice()  # OpenAI's names speak as the default voice
    # (seconds, frames): ceil(seconds / 0.08 s) by hand: 0.93 -> 11.6 -> 12, 1.71 -> 21.4 -> 22, 3.37 -> 42.1 -> 43
    for seconds, frames in ((0.93, 12), (1.71, 22), (3.37, 43)):
        from pipeline.audio import float_to_int16, int16_to_float, resample

        clip = float_to_int16(resample(int16_to_float(_speech(seconds, seed=frames)), RATE_16K, 24_000))
        codes = engine.encoder.encode_audio(clip, 24_000)
        assert codes.shape == (frames, 32)
        own = engine.voices.voice("robot", Segment(0, "my own clip", codes))
        assert own.reference.speaker == 2 and own.reference.codes is codes
        for profile in (robot, own):
            s = engine.stream("Hi there.", engine.voices.context(profile, []), profile.speaker, reference=profile.reference)
            assert len(list(s)) > 0
    assert counter.after_warmup == compiles
    assert engine.stats()["unseen_shape_calls"] == unseen


def test_naive_compiled_encode_recompiles_for_a_new_length(warm, counter):
    """Control: the counter can fail. A compiled ``mimi.encode`` fed raw lengths compiles again."""
    mimi = warm.mimi
    naive = torch.compile(mimi.encode, backend=BACKEND)  # torch's defaults, as a naive caller would
    rng = np.random.default_rng(0)
    with torch.compiler.set_stance("default"), torch.inference_mode():
        naive(torch.from_numpy(rng.standard_normal((1, 1, 7 * CODEC_FRAME_SAMPLES)).astype(np.float32)))
        after_first = counter.total
        naive(torch.from_numpy(rng.standard_normal((1, 1, 11 * CODEC_FRAME_SAMPLES)).astype(np.float32)))
    assert counter.total > after_first


# (samples at 24 kHz, Mimi frames): one frame per 1920 samples (80 ms), the last one partly filled;
# the frame counts worked out by hand, on both sides of the encode buckets (13 and 25 frames)
@pytest.mark.parametrize("samples,frames", [(1, 1), (1919, 1), (1920, 1), (5000, 3), (24_960, 13), (24_961, 14),
                                            (47_000, 25), (48_000, 25), (48_007, 26), (123_457, 65)])
def test_bucketed_encode_equals_plain_encode(warm, samples, frames):
    engine = warm
    wav = (np.random.default_rng(samples).standard_normal(samples) * 0.3).astype(np.float32)
    before = engine.stats()["unseen_shape_calls"]
    got = engine.encoder.encode_wave(wav)
    with torch.inference_mode():
        ref = engine.mimi.encode(torch.from_numpy(wav).view(1, 1, -1))[0].T.numpy()
    assert got.shape == ref.shape == (frames, 32)
    np.testing.assert_array_equal(got, ref)
    assert engine.stats()["unseen_shape_calls"] == before  # padded / pieced: only warmed shapes ran


def test_encode_user_audio_resamples_once(warm):
    from pipeline.audio import int16_to_float, resample

    pcm = _speech(1.3, seed=7)
    wav = resample(int16_to_float(pcm), RATE_16K, 24000)
    np.testing.assert_array_equal(warm.encoder.encode_user_audio(pcm), warm.encoder.encode_wave(wav))
