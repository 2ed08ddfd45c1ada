"""The conversation loop on real tiny engines, in-process (no Ray): ordering, clause handoff,
interruption and clean-up, observed through the protocol messages and the engines' counters."""
from __future__ import annotations

import asyncio

import numpy as np
import pytest

from pipeline import protocol as P
from pipeline.audio import speech_like
from pipeline.llm.config import LLMConfig
from pipeline.services import LLMService, LocalBackends, STTService, TTSService
from pipeline.session import Session, SessionConfig
from pipeline.stt.config import STTConfig
from pipeline.tts.config import TTSConfig


@pytest.fixture(scope="module")
def engines():
    # A deliberately slow LLM (20 ms per token) so that the reply outlasts its first clause.
    # No endpointing: on random weights a run of blanks comes by chance and would split turns.
    return LocalBackends.build(STTConfig.tiny(num_slots=4, endpoint_ms=None),
                               LLMConfig.tiny(token_delay_s=0.02, max_new_tokens=40),
                               TTSConfig.tiny())


@pytest.fixture
def backends(engines):
    """Fresh services (their asyncio locks belong to one event loop) over the loaded engines."""
    b = engines
    return LocalBackends(STTService(b.stt.engine, b.stt.thread), LLMService(b.llm.engine, b.llm.thread),
                         TTSService(b.tts.engine, b.tts.thread))


class Recorder:
    def __init__(self):
        self.msgs: list[dict] = []

    async def __call__(self, frame: bytes) -> None:
        self.msgs.append(P.unpack(frame))

    def turn(self, n):
        return [m for m in self.msgs if m.get("turn") == n]

    async def wait(self, pred, timeout=60):
        for _ in range(int(timeout / 0.01)):
            if any(pred(m) for m in self.msgs):
                return
            await asyncio.sleep(0.01)
        raise TimeoutError("message not seen")


def test_spoken_and_typed_turns_in_order(backends):
    async def go():
        rec = Recorder()
        s = Session(rec, backends, SessionConfig(pace_lead_s=None))
        await s.start()
        pcm = speech_like(2.5, seed=3)
        for i in range(0, len(pcm), 1600):
            await s.on_frame(P.client_audio(pcm[i : i + 1600]))
        await s.on_frame(P.client_turn_end())
        await rec.wait(lambda m: m["type"] == "response.done" and m["turn"] == 1)
        await s.on_frame(P.client_text("How are you?"))
        await rec.wait(lambda m: m["type"] == "response.done" and m["turn"] == 2)
        await s.close()
        return rec, s

    rec, s = asyncio.run(go())
    assert rec.msgs[0]["type"] == "session.ready"
    for n in (1, 2):
        types = [m["type"] for m in rec.turn(n)]
        i = types.index("transcript.final")
        assert set(types[:i]) <= {"transcript.partial"}
        assert types[-1] == "response.done" and "audio" in types and "response.text" in types
        # the first audio of the reply goes out before the (slow) LLM has finished the reply
        assert types.index("audio") < len(types) - 1 - types[::-1].index("response.text")
        seqs = [m["seq"] for m in rec.turn(n) if m["type"] == "audio"]
        assert seqs == list(range(len(seqs)))
    final1, final2 = ([m for m in rec.turn(n) if m["type"] == "transcript.final"][0] for n in (1, 2))
    assert final2["text"] == "How are you?" and "words" not in final2  # typed: no times
    assert final1["text"] and " ".join(w["word"] for w in final1["words"]) == final1["text"].strip()
    assert all(0 <= w["start_ms"] < w["end_ms"] <= 2500 + 80 for w in final1["words"])
    assert [h["role"] for h in s.history] == ["user", "assistant", "user", "assistant"]
    assert s.history[1]["content"] == "".join(m["text"] for m in rec.turn(1) if m["type"] == "response.text").strip()


def test_interruption_truncates_history_and_stops_audio(backends):
    async def go():
        rec = Recorder()
        s = Session(rec, backends, SessionConfig(pace_lead_s=0.1))  # paced: the reply takes real time
        await s.start()
        await s.on_frame(P.client_text("Tell me a long story."))
        await rec.wait(lambda m: m["type"] == "audio" and m["turn"] == 1)
        await s.on_frame(P.client_text("Stop."))
        await rec.wait(lambda m: m["type"] == "response.done" and m["turn"] == 2)
        await s.close()
        return rec, s

    rec, s = asyncio.run(go())
    t1 = rec.turn(1)
    assert t1[-1] == {"type": "response.done", "turn": 1, "interrupted": True}
    done_at = rec.msgs.index(t1[-1])
    assert not any(m.get("turn") == 1 for m in rec.msgs[done_at + 1 :])
    assert rec.msgs.index([m for m in rec.turn(2) if m["type"] == "transcript.final"][0]) > done_at
    full_reply = "".join(m["text"] for m in t1 if m["type"] == "response.text")
    said = s.history[1]["content"]
    assert s.history[1]["role"] == "assistant" and said and len(said) < len(full_reply) + 1
    assert full_reply.replace(" ", "").startswith(said.replace(" ", ""))
    assert rec.turn(2)[-1]["interrupted"] is False


def test_close_mid_reply_leaves_nothing_running(backends):
    async def go():
        rec = Recorder()
        s = Session(rec, backends, SessionConfig(pace_lead_s=0.1))
        await s.start()
        await s.on_frame(P.client_text("Talk for a while, please."))
        await rec.wait(lambda m: m["type"] == "audio")
        await s.close()
        await asyncio.sleep(0.3)  # clean-up of the cancelled streams runs on the inference threads
        return backends.llm.stats(), backends.tts.stats(), backends.stt.stats()

    llm, tts, stt = asyncio.run(go())
    assert llm["active_requests"] == 0 and tts["active_requests"] == 0 and stt["active_streams"] == 0


async def _say(s, pcm, frame=1600):
    for i in range(0, len(pcm), frame):
        await s.on_frame(P.client_audio(pcm[i : i + frame]))


def test_barge_in_by_speech(backends):
    async def go():
        rec = Recorder()
        s = Session(rec, backends, SessionConfig(pace_lead_s=0.1, barge_in_grace_s=0.3))
        await s.start()
        await s.on_frame(P.client_text("Tell me a long story."))
        await rec.wait(lambda m: m["type"] == "audio" and m["turn"] == 1)
        await asyncio.sleep(0.4)  # past the grace period
        await _say(s, speech_like(2.5, seed=11))  # the user talks over the reply
        await rec.wait(lambda m: m["type"] == "response.done" and m["turn"] == 1)
        await s.on_frame(P.client_turn_end())
        await rec.wait(lambda m: m["type"] == "response.done" and m["turn"] == 2)
        await s.close()
        return rec, s

    rec, s = asyncio.run(go())
    done1 = [m for m in rec.turn(1) if m["type"] == "response.done"]
    assert done1 == [{"type": "response.done", "turn": 1, "interrupted": True}]
    i_done = rec.msgs.index(done1[0])
    assert not any(m.get("turn") == 1 for m in rec.msgs[i_done + 1 :])  # no audio of turn 1 after
    partials2 = [rec.msgs.index(m) for m in rec.turn(2) if m["type"] == "transcript.partial"]
    assert partials2 and partials2[0] > i_done  # interrupted before the new turn's first partial
    assert rec.turn(2)[-1]["type"] == "response.done" and rec.turn(2)[-1]["interrupted"] is False
    said = s.history[1]["content"]
    full = "".join(m["text"] for m in rec.turn(1) if m["type"] == "response.text")
    assert said and full.replace(" ", "").startswith(said.replace(" ", "")) and len(said) < len(full)


def test_quiet_noise_does_not_barge_in(backends):
    async def go():
        rec = Recorder()
        s = Session(rec, backends, SessionConfig(pace_lead_s=0.1, barge_in_grace_s=0.0))
        await s.start()
        await s.on_frame(P.client_text("Tell me a long story."))
        await rec.wait(lambda m: m["type"] == "audio" and m["turn"] == 1)
        rng = np.random.default_rng(0)
        await _say(s, (rng.standard_normal(40000) * 100).astype(np.int16))  # rms ~0.003 of full scale
        await rec.wait(lambda m: m["type"] == "response.done" and m["turn"] == 1)
        await s.close()
        return rec

    rec = asyncio.run(go())
    assert rec.turn(1)[-1]["interrupted"] is False
    assert any(m["type"] == "transcript.partial" for m in rec.turn(2))  # the recogniser did hear "words"


class SpyBackends:
    """Delegates to real backends and records what the TTS was given and what it generated."""

    def __init__(self, inner):
        self.inner = inner
        self.calls: list[dict] = []
        self.encoded: list[np.ndarray] = []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    async def tts_encode(self, pcm):
        codes = await self.inner.tts_encode(pcm)
        self.encoded.append(codes)
        return codes

    async def tts_stream(self, text, context):
        call = {"text": text, "context": list(context), "codes": []}
        self.calls.append(call)
        async for pcm, codes in self.inner.tts_stream(text, context):
            call["codes"].append(codes)
            yield pcm, codes


def test_tts_context_holds_earlier_turns(backends):
    spy = SpyBackends(backends)

    async def go():
        rec = Recorder()
        s = Session(rec, spy, SessionConfig(pace_lead_s=None, context_turns=4))
        await s.start()
        turn_calls = {}
        for n, spoken in enumerate([True, False, True, False], start=1):
            first_call = len(spy.calls)
            if spoken:
                await _say(s, speech_like(1.2 + 0.5 * n, seed=n))
                await s.on_frame(P.client_turn_end())
            else:
                await s.on_frame(P.client_text(f"Typed turn number {n}, please answer."))
            await rec.wait(lambda m, n=n: m["type"] == "response.done" and m["turn"] == n)
            turn_calls[n] = spy.calls[first_call:]
        await s.close()
        return turn_calls

    turn_calls = asyncio.run(go())
    bot_codes = {n: np.concatenate([c for call in calls for c in call["codes"]]) for n, calls in turn_calls.items()}
    user1, user3 = spy.encoded
    ctx4 = turn_calls[4][0]["context"]  # first clause of turn 4
    # budget of 4 segments: user 1 dropped; bot 1, bot 2, user 3, bot 3 remain, oldest first
    assert [seg.speaker for seg in ctx4] == [0, 0, 1, 0]
    np.testing.assert_array_equal(ctx4[0].codes, bot_codes[1])
    np.testing.assert_array_equal(ctx4[1].codes, bot_codes[2])
    np.testing.assert_array_equal(ctx4[2].codes, user3)
    np.testing.assert_array_equal(ctx4[3].codes, bot_codes[3])
    # turn 2 saw the user's first turn (encoded once) and the bot's first reply
    ctx2 = turn_calls[2][0]["context"]
    assert [seg.speaker for seg in ctx2] == [1, 0]
    np.testing.assert_array_equal(ctx2[0].codes, user1)
    assert len(spy.encoded) == 2  # typed turns have no audio; nothing generated is re-encoded
    # later clauses of one reply continue from the earlier clauses' codes
    for calls in turn_calls.values():
        for k, call in enumerate(calls[1:], start=1):
            np.testing.assert_array_equal(call["context"][-1].codes,
                                          np.concatenate([c for prev in calls[:k] for c in prev["codes"]]))
