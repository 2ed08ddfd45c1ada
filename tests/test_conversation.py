"""The conversation core alone, as event lists: typed commands in, the typed events it emits out,
with no wire format and scripted engines (no models), so each rule is checked where it lives.

Every other protocol test (v1, Realtime, e2e) goes through an adapter; these name the rules the
adapters must not hold: the response lifecycle (one TurnDone per turn, across the replies that
answer it), one active reply, what a cut reply keeps, and checks before anything changes.
"""
from __future__ import annotations

import asyncio

import numpy as np
import pytest

from pipeline.conversation.agent import BadSetting
from pipeline.audio_constants import USER_RATE
from pipeline.conversation import Conversation, Refusal
from pipeline.conversation import commands as C
from pipeline.conversation import events as E
from pipeline.engines import ToolCall
from pipeline.conversation.history import Item
from pipeline.session_config import SessionConfig


class Engines:
    """Scripted engines: each LLM call plays the next script (text deltas and ToolCalls); the TTS
    makes one 80 ms chunk per word; the recogniser hears ``transcript`` in whatever audio it gets."""

    def __init__(self, *scripts, transcript: str = "hello there"):
        self.scripts = list(scripts)
        self.transcript = transcript
        self.pushed = 0  # samples the recogniser got

    async def llm_stream(self, messages, sampling=None):
        for delta in self.scripts.pop(0):
            yield delta

    async def tts_stream(self, text, context, voice=None):
        for i, _ in enumerate(text.split()):
            yield np.full(1920, i + 1, np.int16), np.zeros((1, 32), np.int64)

    async def tts_encode(self, pcm, rate=USER_RATE):
        return np.zeros((1, 32), np.int64)

    async def stt_open(self, sid, language=None):
        pass

    async def stt_push(self, sid, pcm):
        self.pushed += len(pcm)
        return []

    async def stt_finish(self, sid):
        return self.transcript, [{"word": w} for w in self.transcript.split()]

    async def stt_peek(self, sid):
        return None

    async def stt_close(self, sid):
        pass


def _conversation(engines: Engines, pace_lead_s: float | None = None):
    events: list = []

    async def emit(event) -> None:
        events.append(event)

    # pace_lead_s None: audio as fast as it is made; 0: at real time (a reply that is still playing)
    cfg = SessionConfig(turn_detection="manual", barge_in="off", vad_events=False, pace_lead_s=pace_lead_s)
    return Conversation(emit, engines, cfg), events


async def _settled(conv: Conversation) -> None:
    while conv.replies.reply is not None and conv.replies.reply.running:
        await conv.replies.reply.task


def _kinds(events) -> list[str]:
    return [type(e).__name__ for e in events]


def test_a_typed_turn_is_answered_and_its_response_ends_once():
    async def go():
        conv, events = _conversation(Engines(["Hi there. ", "Bye."]))
        await conv.do(C.UserText("Hello"))
        await _settled(conv)
        return conv, events

    conv, events = asyncio.run(go())
    assert _kinds(events) == ["TurnEnded", "ReplyStarted", "ReplyText", "ReplyText", "ReplyAudio", "ReplyAudio",
                              "ReplyAudio", "ReplyDone", "TurnDone"]
    ended, done, turn_done = events[0], events[-2], events[-1]
    assert (ended.turn, ended.text, ended.previous_id) == (1, "Hello", None)
    assert [e.seq for e in events if isinstance(e, E.ReplyAudio)] == [0, 1, 2]
    assert done.transcript == "Hi there. Bye." and done.reply.status == "completed"
    assert (turn_done.turn, turn_done.interrupted) == (1, False)
    assert [m["content"] for m in conv.shared.history.messages()] == ["Hello", "Hi there. Bye."]


def test_a_cut_reply_keeps_what_was_said_and_the_next_turn_follows_its_end():
    async def go():
        conv, events = _conversation(Engines(["One two three four. ", "Five six seven eight."], ["Sure."]), 0.0)
        await conv.do(C.UserText("Count"))
        while not any(isinstance(e, E.ReplyAudio) for e in events):
            await asyncio.sleep(0)
        await conv.do(C.UserText("Stop"))  # 80 ms of the 640 ms reply have been sent
        await _settled(conv)
        return conv, events

    conv, events = asyncio.run(go())
    first_done = next(e for e in events if isinstance(e, E.ReplyDone))
    assert first_done.reply.status == "cancelled" and first_done.reply.reason == "turn_detected"
    assert first_done.transcript == "One two three four."  # said: its first chunk went out; the second clause not
    kinds = _kinds(events)
    cut = kinds.index("ReplyDone")
    assert kinds[cut:cut + 3] == ["ReplyDone", "TurnDone", "TurnEnded"]  # the old response ends, then the new turn
    assert events[cut + 1].interrupted and events[cut + 2].turn == 2
    assert [m["content"] for m in conv.shared.history.messages()] == ["Count", "One two three four.", "Stop", "Sure."]


def test_a_turn_answered_over_a_tool_call_ends_once_and_numbers_its_audio_across_replies():
    call = ToolCall("call_1", "weather", '{"city": "Paris"}')

    async def go():
        conv, events = _conversation(Engines(["Let me see. ", call], ["It is sunny."]))
        await conv.do(C.UserText("Weather in Paris?"))
        await _settled(conv)
        before = list(events)
        await conv.do(C.ToolResult("call_1", "sunny", then="respond"))
        await _settled(conv)
        return before, events

    before, events = asyncio.run(go())
    assert "TurnDone" not in _kinds(before)  # the response waits on the result
    asked = next(e for e in before if isinstance(e, E.ToolCallAsked))
    assert asked.call == call and asked.item.kind == "function_call"
    assert _kinds(events).count("ReplyDone") == 2 and _kinds(events).count("TurnDone") == 1
    assert events[-1] == E.TurnDone(1, False, events[-2].reply.marks)
    seqs = [e.seq for e in events if isinstance(e, E.ReplyAudio)]
    assert seqs == list(range(len(seqs))) and len(seqs) == 6  # 3 words, then 3: one count across both replies


def test_one_active_reply_and_cancels_of_none_are_refused_with_nothing_changed():
    async def go():
        conv, events = _conversation(Engines(["A long answer that plays for a while here."]), 0.0)
        await conv.do(C.Respond())
        with pytest.raises(Refusal) as busy:
            await conv.do(C.Respond())
        count = len(events)
        await conv.do(C.CancelReply())
        with pytest.raises(Refusal) as none:
            await conv.do(C.CancelReply())
        return busy.value, none.value, events, count

    busy, none, events, count = asyncio.run(go())
    assert busy.code == "conversation_already_has_active_response"
    assert none.code == "response_cancel_not_active" and none.param == "response_id"
    # the cancel ended the one reply, once; it answered no user turn, so no turn's response ends
    assert _kinds(events[count:]) == ["ReplyDone"]
    assert events[count].reply.reason == "client_cancelled"


def test_bad_overrides_are_refused_before_the_turn_ends():
    async def go():
        conv, events = _conversation(Engines(["Hi."]))
        with pytest.raises(BadSetting) as bad:
            await conv.do(C.UserText("Hello", overrides={"temperature": 9}))
        return conv, events, bad.value

    conv, events, bad = asyncio.run(go())
    assert bad.param == "temperature" and events == [] and conv.shared.turn == 0 and not conv.shared.history.items


def test_a_spoken_turn_is_recognised_and_its_audio_counted():
    async def go():
        engines = Engines(["Hi."], transcript="what time is it")
        conv, events = _conversation(engines)
        for _ in range(3):
            await conv.do(C.Hear(np.zeros(USER_RATE // 2, np.int16)))
        await conv.do(C.EndTurn(respond=False))
        return conv, events, engines

    conv, events, engines = asyncio.run(go())
    assert _kinds(events) == ["TurnEnded"]  # respond=False: no reply
    ended = events[0]
    assert ended.text == "what time is it" and ended.audio_s == 1.5 and engines.pushed == 3 * USER_RATE // 2
    assert ended.item.audio and ended.words == [{"word": w} for w in "what time is it".split()]
    assert conv.shared.history.messages() == [{"role": "user", "content": "what time is it"}]


def test_unknown_items_and_bad_truncations_are_refused():
    async def go():
        conv, _ = _conversation(Engines())
        refusals = []
        for command in (C.DeleteItem("nope"), C.Truncate("nope", 10), C.Truncate("nope", -1),
                        C.AddItem(Item("user", "x"), after="nope")):
            with pytest.raises(Refusal) as refused:
                await conv.do(command)
            refusals.append((refused.value.code, refused.value.param))
        return refusals

    assert asyncio.run(go()) == [("item_not_found", "item_id"), ("item_not_found", "item_id"),
                                 ("invalid_value", "audio_end_ms"), ("item_not_found", "previous_item_id")]
