"""The TTS service over one batched engine: many async consumers at once, each gets the audio its
stream makes alone, whatever its consumer does between chunks (tiny profile, CPU)."""
from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from pipeline import metrics
from pipeline.runtime.threads import InferenceThread
from pipeline.services import TTSService
from pipeline.tts.config import TTSConfig
from pipeline.tts.engine import TTSEngine

torch.set_num_threads(1)

SHORT, LONG = "The weather is fine.", "Hello there, how are you doing today? I hope the rain stays away."


@pytest.fixture(scope="module")
def served():
    thread = InferenceThread("tts-service-test")
    # one batch width: sampled codes are then bit-identical alone and in a batch
    engine = thread.call(TTSEngine, TTSConfig.tiny(max_frames=40, max_seq_len=256, num_slots=4, batch_widths=(4,)))
    return engine, thread


def _alone(engine, thread, text, seed) -> np.ndarray:
    """Codes of ``text`` as the engine's single-stream API makes them with ``seed``."""
    def run():
        s = engine.stream(text, seed=seed)
        for _ in s:
            pass
        return s.codes
    return thread.call(run)


async def _collect(svc, text, hold: asyncio.Event | None = None) -> np.ndarray:
    codes = []
    async for _pcm, c in svc.stream(text):
        codes.append(c)
        if hold is not None:  # the consumer is busy elsewhere (pacing, a slow socket) after its first chunk
            await hold.wait()
            hold = None
    return np.concatenate(codes)


def _next_seed(engine, seed):
    engine._next_seed = seed  # the service's streams take the engine's next seeds, in opening order


def test_a_consumer_busy_while_its_stream_ends_still_gets_the_end(served):
    """A's consumer holds its first chunk until B (longer, batched with A) has run to its end, so
    A's stream ends, and the stepping stops, while A's consumer is not looking. A must still get
    every chunk and finish (a wake-up lost here left a reply waiting forever)."""
    engine, thread = served

    async def go():
        svc = TTSService(engine, thread)
        hold = asyncio.Event()
        a = asyncio.create_task(_collect(svc, SHORT, hold))
        b = await asyncio.wait_for(_collect(svc, LONG), 60)
        assert engine.active_requests == 0  # both ended while A's consumer held its first chunk
        hold.set()
        return await asyncio.wait_for(a, 10), b

    a, b = asyncio.run(go())
    assert len(a) == engine.max_frames_for(SHORT) and len(b) == engine.max_frames_for(LONG)


def test_many_consumers_at_once_match_alone_and_early_stop_frees_the_slot(served):
    """Five consumers (one more than the slots, so one waits) and one that leaves after its first
    chunk: each of the five gets exactly the codes its stream makes alone with the same seed."""
    engine, thread = served
    texts = [SHORT, LONG, "A third one, of middling length.", "Fourth.", "Fifth waits for a slot."]
    want = [_alone(engine, thread, t, 100 + i) for i, t in enumerate(texts)]

    busy = metrics.TTS_SLOTS_BUSY.labels(deployment="tts")

    async def go():
        svc = TTSService(engine, thread)
        thread.call(_next_seed, engine, 100)
        tasks = []
        for t in texts:  # each task opens its stream (on the one inference thread) before the next starts
            tasks.append(asyncio.create_task(_collect(svc, t)))
            await asyncio.sleep(0)
        stopped = svc.stream(LONG)
        await anext(stopped)
        in_use = busy._value.get()  # voice_tts_slots_busy while every slot is taken
        await stopped.aclose()
        return await asyncio.wait_for(asyncio.gather(*tasks), 120), in_use

    got, in_use = asyncio.run(go())
    for t, codes, ref in zip(texts, got, want):
        np.testing.assert_array_equal(codes, ref, err_msg=t)
    assert engine.active_requests == 0
    assert 1 <= in_use <= engine.num_slots and busy._value.get() == 0  # its stream held a slot; then all freed
    assert metrics.TTS_SLOTS.labels(deployment="tts")._value.get() == engine.num_slots


def test_a_long_turn_is_encoded_a_piece_at_a_time_with_frame_steps_between(served, monkeypatch):
    """A user turn longer than the largest encode bucket (20 s here: three pieces) is encoded for
    the context one piece per call on the inference thread, so the streams' frame steps run between
    the pieces: encoded in one call, it held every stream for its whole length (a chunk gap over
    500 ms in another conversation, tests/e2e/test_door.py). Its codes equal the one-call encode's,
    and two long encodes at once each get their own (the encoder's streaming state is one)."""
    from pipeline.audio import speech_like
    from pipeline.audio_constants import USER_RATE

    engine, thread = served
    turns = [np.clip(speech_like(20.0, USER_RATE, seed=s) * 32767, -32768, 32767).astype(np.int16) for s in (1, 2)]
    alone = [thread.call(engine.encoder.encode_audio, pcm, USER_RATE) for pcm in turns]
    order: list[str] = []  # appended on the inference thread only
    step, piece = engine.step, engine.encoder.piece_fn
    monkeypatch.setattr(engine, "step", lambda: (order.append("step"), step())[1])
    monkeypatch.setattr(engine.encoder, "piece_fn", lambda x: (order.append("piece"), piece(x))[1])

    async def go():
        svc = TTSService(engine, thread)
        speaking = asyncio.Event()

        async def reply():
            async for _ in svc.stream(LONG):
                speaking.set()

        replies = [asyncio.create_task(reply()) for _ in range(2)]
        await speaking.wait()  # the streams are stepping
        one = await svc.encode(turns[0], USER_RATE)
        both = await asyncio.gather(*(svc.encode(pcm, USER_RATE) for pcm in turns))
        await asyncio.gather(*replies)
        return one, both

    one, both = asyncio.run(go())
    assert np.array_equal(one, alone[0])
    assert all(np.array_equal(got, want) for got, want in zip(both, alone))
    first = order.index("piece")
    assert "step" in order[first:order.index("piece", first + 1)]  # a frame step between the first two pieces
