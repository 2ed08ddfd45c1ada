"""The record of a call (pipeline/conversation/call_record.py) and the cause of its dead air
(pipeline/conversation/dead_air.py), in-process with scripted engines: a gap is made on purpose at
each stage (a slowed TTS step, a slowed LLM token, a client that stops reading, an engine that
fails mid-reply) and the record must name that stage; a reply with none keeps no gap."""
from __future__ import annotations

import asyncio

import numpy as np

from pipeline.conversation import Conversation
from pipeline.conversation import commands as C
from pipeline.conversation import events as E
from pipeline.conversation.observer import Observer
from pipeline.engines import EngineUnavailable
from pipeline.session_config import SessionConfig
from tests.test_conversation import Engines

STALL_S = 0.5  # each injected stall; a reply's audio runs ahead of it by at most 3 chunks (240 ms)


class SlowEngines(Engines):
    """Scripted engines that stall on purpose: a float in an LLM script is a pause before the next
    delta; ``tts_stall_at``: the TTS stalls before that chunk of its first clause; ``tts_fails_at``:
    it stalls there and then fails as a dead replica would."""

    def __init__(self, *scripts, tts_stall_at: int | None = None, tts_fails_at: int | None = None):
        super().__init__(*scripts)
        self.tts_stall_at, self.tts_fails_at, self.clauses = tts_stall_at, tts_fails_at, 0

    async def llm_stream(self, messages, sampling=None):
        for delta in self.scripts.pop(0):
            if isinstance(delta, float):
                await asyncio.sleep(delta)
            else:
                yield delta

    async def tts_stream(self, text, context, voice=None):
        self.clauses += 1
        for i, _ in enumerate(text.split()):
            if self.clauses == 1 and i in (self.tts_stall_at, self.tts_fails_at):
                await asyncio.sleep(STALL_S)
                if i == self.tts_fails_at:
                    raise EngineUnavailable("the TTS replica died")
            yield np.full(1920, i + 1, np.int16), np.zeros((1, 32), np.int64)


class Heard(Observer):
    """What the metrics hear of dead air."""

    def __init__(self):
        self.gaps: list[tuple[float, str]] = []

    def dead_air(self, seconds: float, cause: str) -> None:
        self.gaps.append((seconds, cause))


def _run(engines: Engines, client_stall_at: int | None = None) -> tuple[Conversation, list, Heard]:
    """One typed turn and its reply, audio sent as fast as it is made (pace_lead_s None), so only a
    late stage leaves the client's audio to run out."""
    heard = Heard()
    events: list = []

    async def go():
        async def emit(event) -> None:
            events.append(event)
            if isinstance(event, E.ReplyAudio) and event.seq == client_stall_at:
                await asyncio.sleep(STALL_S)  # a client that stops reading: the socket's send waits

        cfg = SessionConfig(turn_detection="manual", barge_in="off", vad_events=False, pace_lead_s=None)
        conv = Conversation(emit, engines, cfg, observer=heard)
        await conv.do(C.UserText("Count for me"))
        while conv.replies.reply is not None and conv.replies.reply.running:
            await conv.replies.reply.task
        return conv

    return asyncio.run(go()), events, heard


def _gaps(conv: Conversation) -> list[dict]:
    return [g for t in conv.record.as_dict()["turns"] for r in t["replies"] for g in r["gaps"]]


def _one_gap(conv: Conversation, heard: Heard) -> dict:
    gaps = _gaps(conv)
    assert len(gaps) == 1, gaps
    assert [cause for _, cause in heard.gaps] == [gaps[0]["cause"]]  # the metric hears it too
    # the audio sent ran out 3 chunks (240 ms) in, and the stall lasted STALL_S from about the start
    assert gaps[0]["at_ms"] == 240
    assert 150 <= gaps[0]["ms"] <= 1000 * STALL_S, gaps
    return gaps[0]


def test_a_reply_with_no_stall_keeps_no_gap():
    conv, _, heard = _run(SlowEngines(["One two three. ", "Four five six."]))
    assert _gaps(conv) == [] and heard.gaps == []


def test_a_slowed_llm_token_is_blamed_on_the_llm():
    conv, _, heard = _run(SlowEngines(["One two three. ", STALL_S, "Four five six."]))
    assert _one_gap(conv, heard)["cause"] == "llm"


def test_a_slowed_tts_step_is_blamed_on_the_tts():
    conv, _, heard = _run(SlowEngines(["One two three four five six."], tts_stall_at=3))
    assert _one_gap(conv, heard)["cause"] == "tts"


def test_a_client_that_stops_reading_is_blamed_on_the_client():
    conv, _, heard = _run(SlowEngines(["One two three four five six."]), client_stall_at=2)
    assert _one_gap(conv, heard)["cause"] == "client"


def test_an_engine_lost_mid_reply_is_blamed_on_it():
    conv, _, heard = _run(SlowEngines(["One two three four five six."], tts_fails_at=3))
    gap = _one_gap(conv, heard)
    assert gap["cause"] == "engine_unavailable"
    reply = conv.record.as_dict()["turns"][0]["replies"][0]
    assert reply["status"] == "failed" and reply["reason"] == "engine_unavailable"


def test_the_record_keeps_each_turn_what_was_said_and_heard_and_when():
    conv, events, _ = _run(SlowEngines(["Hi there. ", "Bye now."]))
    record = conv.record.as_dict()
    assert record["session_id"] == conv.id
    (turn,) = record["turns"]
    assert (turn["turn"], turn["user"], turn["spoken"], turn["ended_by"]) == (1, "Count for me", False, "typed")
    (reply,) = turn["replies"]
    assert reply["said"] == reply["heard"] == "Hi there. Bye now."
    assert reply["answers"] == "Count for me"
    assert reply["status"] == "completed" and reply["audio_ms"] == 4 * 80
    assert reply["voice_to_voice_ms"] is None  # a typed turn: no speech to count from
    assert set(reply["timings"]) == {"llm_first_token_ms", "first_clause_ms", "tts_request_ms", "tts_first_chunk_ms",
                                     "first_audio_ms"}
    t = reply["timings"]
    assert t["llm_first_token_ms"] <= t["first_clause_ms"] <= t["tts_request_ms"] <= t["tts_first_chunk_ms"] \
        <= t["first_audio_ms"]
    done = next(e for e in events if isinstance(e, E.TurnDone))
    assert round(done.timings["tts_first_chunk_ms"]) == t["tts_first_chunk_ms"]  # the client's timings have it too


def test_a_cut_reply_keeps_what_was_heard_and_the_record_is_bounded(monkeypatch):
    async def go():
        events: list = []

        async def emit(event) -> None:
            events.append(event)

        scripts = [["One two three four. ", "Five six seven eight."]] + [["Sure."]] * 3
        cfg = SessionConfig(turn_detection="manual", barge_in="off", vad_events=False, pace_lead_s=0.0)
        conv = Conversation(emit, Engines(*scripts), cfg)
        await conv.do(C.UserText("Count"))
        while not any(isinstance(e, E.ReplyAudio) for e in events):
            await asyncio.sleep(0)
        await conv.do(C.UserText("Stop"))
        for _ in range(2):
            while conv.replies.running:
                await conv.replies.reply.task
            await conv.do(C.UserText("Again"))
        while conv.replies.running:
            await conv.replies.reply.task
        return conv

    from pipeline.conversation import call_record

    monkeypatch.setattr(call_record, "MAX_TURNS", 3)
    conv = asyncio.run(go())
    record = conv.record.as_dict()
    assert [t["turn"] for t in record["turns"]] == [2, 3, 4] and record["turns_dropped"] == 1
    conv2 = asyncio.run(_cut_only())
    cut = conv2.record.as_dict()["turns"][0]["replies"][0]
    assert cut["status"] == "cancelled" and cut["said"] == "One two three four. Five six seven eight."
    assert cut["heard"] == "One two three four."  # what was sent of it, not all it wrote


async def _cut_only() -> Conversation:
    events: list = []

    async def emit(event) -> None:
        events.append(event)

    cfg = SessionConfig(turn_detection="manual", barge_in="off", vad_events=False, pace_lead_s=0.0)
    conv = Conversation(emit, Engines(["One two three four. ", "Five six seven eight."], ["Sure."]), cfg)
    await conv.do(C.UserText("Count"))
    while not any(isinstance(e, E.ReplyAudio) for e in events):
        await asyncio.sleep(0)
    await conv.do(C.UserText("Stop"))
    while conv.replies.running:
        await conv.replies.reply.task
    return conv


def test_the_timeline_says_where_the_dead_air_came_from():
    from load.record import timeline

    conv, _, _ = _run(SlowEngines(["One two three. ", STALL_S, "Four five six."]))
    text = timeline(dict(conv.record.as_dict(), transport="v1"))
    assert "turn 1: user typed 'Count for me'" in text and "after the turn's end: first token" in text
    assert "said  'One two three. Four five six.'" in text
    dead = [line for line in text.splitlines() if "DEAD AIR" in line]
    assert len(dead) == 1 and dead[0].endswith("at 240 ms into the reply: llm")
