"""A long conversation stays cheap (security review, issue 25 finding 2): the LLM's prompt building
counts tokens O(log n) times, not once per dropped turn, and the session's history is bounded as
it grows (SessionConfig.max_history_chars), so neither the LLM's inference thread nor the wire to
it pays for a history that only grows. Fast: fake backends for the conversation, the tiny
tokenizer for the prompt; no Ray."""
from __future__ import annotations

import asyncio
import json
import math
import random

import numpy as np
import pytest

from pipeline.conversation import Conversation
from pipeline.conversation.history import History, Item, UnknownItem, item_chars
from pipeline.llm import LLMConfig, approx_token_count, build_prompt, make_llm
from pipeline.adapters.realtime.adapter import RealtimeSession
from pipeline.session_config import SessionConfig

LONG = "Tell me more about the history of the harbour and its old lighthouse keepers, please. "  # 87 chars


def _reference(history, system_prompt, budget, count):
    """The old build_prompt: drop the oldest turn, recount, again and again (one count a turn)."""
    system = system_prompt or None
    if history and history[0].get("role") == "system":
        system = history[0].get("content") or system
    turns = [dict(m) for m in history if m.get("role") != "system"]
    head = [{"role": "system", "content": system}] if system else []
    user_idx = [i for i, m in enumerate(turns) if m.get("role") == "user"]
    last_user = user_idx[-1] if user_idx else max(len(turns) - 1, 0)
    start = 0
    while start < last_user and count(head + turns[start:]) > budget:
        start += 1
        while start < last_user and turns[start].get("role") != "user":
            start += 1
    return head + turns[start:]


class Counted:
    """A count_tokens that counts its calls."""

    def __init__(self, count):
        self.count, self.calls = count, 0

    def __call__(self, messages, *args):
        self.calls += 1
        return self.count(messages, *args)


def _bound(n: int) -> int:
    return int(2 * math.log2(max(n, 1)) + 3)


def _long_turns(n: int, chars: int = 600, last: str | None = None) -> list[dict]:
    history = []
    for i in range(n):
        history.append({"role": "user", "content": f"{i} " + (LONG * 8)[:chars]})
        history.append({"role": "assistant", "content": f"{i} Sure. " + (LONG * 8)[:chars]})
    history.append({"role": "user", "content": last if last is not None else f"{n} " + (LONG * 8)[:chars]})
    return history


# ----------------------------------------------------------------------------- build_prompt
@pytest.mark.parametrize("budget", [1, 150, 600, 2_000, 10_000, 100_000])
def test_build_prompt_on_200_long_turns_is_the_old_result_in_log_n_counts(budget):
    history = _long_turns(200)
    counted = Counted(approx_token_count)
    out = build_prompt(history, "be brief", budget, count_tokens=counted)
    assert out == _reference(history, "be brief", budget, approx_token_count)
    assert counted.calls <= _bound(len(history)), counted.calls
    assert out[0] == {"role": "system", "content": "be brief"} and out[-1] == history[-1]
    assert out[1]["role"] == "user"
    if len(out) > 2:  # more than the latest user turn: it fits
        assert approx_token_count(out) <= budget


def test_build_prompt_equals_the_reference_on_odd_histories():
    """Any mix of roles (histories that start with a reply, hold tool messages, end with a reply
    or hold no user turn at all), any budget: the same messages, O(log n) counts."""
    rng = random.Random(7)
    roles = ["user", "assistant", "tool", "assistant", "user"]
    for _ in range(400):
        n = rng.randrange(0, 60)
        history = [{"role": rng.choice(roles), "content": "w " * rng.randrange(0, 30)} for _ in range(n)]
        if rng.random() < 0.2:
            history.insert(0, {"role": "system", "content": "custom"})
        budget = rng.randrange(0, 600)
        system = rng.choice([None, "", "be brief"])
        counted = Counted(approx_token_count)
        assert build_prompt(history, system, budget, count_tokens=counted) == \
            _reference(history, system, budget, approx_token_count), (history, system, budget)
        assert counted.calls <= _bound(n), (counted.calls, n)


@pytest.fixture(scope="module")
def tiny_llm():
    return make_llm(LLMConfig.tiny())


def test_tiny_llm_prompt_stays_in_budget_after_200_long_typed_turns(tiny_llm):
    engine, cfg = tiny_llm, tiny_llm.cfg
    counted = Counted(engine.count_prompt_tokens)
    engine.count_prompt_tokens = counted  # what prompt_ids counts with (an instance attribute: this test's engine)
    try:
        # 200 long typed turns, then a short one (a long turn of the tiny tokenizer is some 400 tokens)
        history = _long_turns(200, last="And the lighthouse?")
        ids = engine.prompt_ids(history)
        assert len(ids) <= cfg.history_tokens
        text = engine.tokenizer.decode(ids)
        assert text.rstrip().endswith("And the lighthouse?<|eot_id|><|start_header_id|>assistant<|end_header_id|>")
        assert cfg.system_prompt.split(".")[0] in text
        assert counted.calls <= _bound(len(history)), counted.calls
        # the latest turn long too: over the budget alone, it is all that is kept, cut to the context
        history = _long_turns(200)
        ids = engine.prompt_ids(history)
        assert len(ids) <= cfg.max_context_tokens - cfg.max_output_tokens
        assert "199 Sure." not in engine.tokenizer.decode(ids)
    finally:
        del engine.count_prompt_tokens


@pytest.mark.parametrize("budget", [400, 700, 1_000])
def test_tiny_llm_prompt_is_the_old_result_with_exact_counts(tiny_llm, budget):
    """With the exact templated length (40 turns: the old loop's cost grows with the square)."""
    engine = tiny_llm
    history = _long_turns(40, chars=120)
    counted = Counted(engine.count_prompt_tokens)
    out = build_prompt(history, engine.cfg.system_prompt, budget, count_tokens=counted)
    assert out == _reference(history, engine.cfg.system_prompt, budget, engine.count_prompt_tokens)
    assert counted.calls <= _bound(len(history))
    assert engine.count_prompt_tokens(out) <= budget and len(out) > 2  # several turns kept, within budget


# ----------------------------------------------------------------------------- the session's history
class FakeBackends:
    """A reply of ``reply`` in one delta, and silence from the TTS; records what the LLM was sent."""

    def __init__(self, reply: str):
        self.reply = reply
        self.sent: list[list[dict]] = []

    async def llm_stream(self, messages, **options):
        self.sent.append(messages)
        yield self.reply

    async def tts_stream(self, text, context, voice=None):
        yield np.zeros(1920, np.int16), np.zeros((1, 32), np.int64)

    async def tts_encode(self, pcm, rate=16_000):
        return np.zeros((1, 32), np.int64)


async def quiet(event) -> None:
    """A conversation's emit that goes nowhere."""


def _quiet_cfg(**settings) -> SessionConfig:
    # no VAD and no Smart Turn (no models), audio as fast as it is made, and typed turns as fast as
    # the test sends them (the reply rate has its own test: tests/test_door_limits.py)
    settings.setdefault("replies_burst", 1_000)
    return SessionConfig(turn_detection="manual", barge_in="off", vad_events=False, pace_lead_s=None, **settings)


def test_history_stays_under_its_cap_after_200_long_typed_turns():
    def user(i: int) -> str:  # typed turns of 300 to 1800 characters
        return f"{i} " + (LONG * 25)[:300 + (i * 397) % 1_500].strip()

    backends = FakeBackends("Sure. " + (LONG * 20)[:1_500].strip())
    cfg = _quiet_cfg()
    cap = cfg.max_history_chars

    async def go():
        conv = Conversation(quiet, backends, cfg)
        first = None
        for i in range(200):
            item = await conv.user_turns.user_text(user(i))
            first = first or item
            await conv.replies.reply.task
            assert conv.shared.history.chars <= cap
            assert conv.shared.history.chars == sum(item_chars(it) for it in conv.shared.history.items)  # the running total
            assert conv.shared.history.items[0].role == "user"  # whole turns left: it starts with one
        return conv, first

    conv, first = asyncio.run(go())
    msgs = conv.shared.history.messages()
    assert sum(len(m["content"]) for m in msgs) <= cap
    assert sum(len(m["content"]) for m in msgs) > cap - 3_400  # close to it: one more turn would not fit
    # the latest turns intact, in order, whole: a user turn, its reply, the next user turn...
    assert [m["role"] for m in msgs] == ["user", "assistant"] * (len(msgs) // 2)
    n = len(msgs) // 2
    for k, i in enumerate(range(200 - n, 200)):
        assert msgs[2 * k] == {"role": "user", "content": user(i)}
        assert msgs[2 * k + 1] == {"role": "assistant", "content": backends.reply}
    # what went to the LLM was bounded too (the latest user turn on top of a history under the cap)
    assert len(backends.sent) == 200
    assert max(sum(len(m["content"]) for m in sent) for sent in backends.sent) <= cap
    assert backends.sent[-1][-1] == {"role": "user", "content": user(199)}
    with pytest.raises(UnknownItem):  # a dropped item is unknown, as a deleted one
        conv.shared.history.get(first.id)


def test_dropped_items_are_unknown_to_realtime_item_events():
    events: list[dict] = []

    async def wire(frame: str) -> None:
        events.append(json.loads(frame))

    async def send(s, **event):
        await s.on_frame(json.dumps(event))

    def text_item(i: int) -> dict:
        return {"type": "message", "role": "user", "content": [{"type": "input_text", "text": f"{i} " + LONG * 5}]}

    async def go():
        s = RealtimeSession(wire, FakeBackends("ok"), _quiet_cfg(max_history_chars=2_000))
        await s.start()
        for i in range(10):
            await send(s, type="conversation.item.create", item=text_item(i))
        added = [e["item"]["id"] for e in events if e["type"] == "conversation.item.added"]
        assert len(added) == 10
        kept = [item.id for item in s.core.shared.history.items]
        dropped = [i for i in added if i not in kept]
        assert kept == added[-len(kept):] and dropped and s.core.shared.history.chars <= 2_000
        before = len(events)
        await send(s, type="conversation.item.delete", item_id=dropped[0], event_id="del")
        await send(s, type="conversation.item.retrieve", item_id=dropped[0], event_id="get")
        await send(s, type="conversation.item.truncate", item_id=dropped[0], content_index=0, audio_end_ms=0,
                   event_id="cut")
        await send(s, type="conversation.item.create", previous_item_id=dropped[-1], item=text_item(99),
                   event_id="after")
        await send(s, type="conversation.item.retrieve", item_id=kept[-1], event_id="kept")
        await send(s, type="conversation.item.delete", item_id=kept[0], event_id="del-kept")
        await s.close()
        return events[before:], kept

    out, kept = asyncio.run(go())
    errors = [(e["error"]["event_id"], e["error"]["code"]) for e in out if e["type"] == "error"]
    assert errors == [("del", "item_not_found"), ("get", "item_not_found"), ("cut", "item_not_found"),
                      ("after", "item_not_found")]
    assert [e["item"]["id"] for e in out if e["type"] == "conversation.item.retrieved"] == [kept[-1]]
    assert [e["item_id"] for e in out if e["type"] == "conversation.item.deleted"] == [kept[0]]


# ----------------------------------------------------------------------------- History's bound
def test_a_call_leaves_with_its_output_and_the_latest_user_turn_stays():
    h = History(max_chars=100)
    u1 = h.add(Item("user", "a" * 30))
    call = h.add(Item.call("c1", "lookup", "{}"))
    out = h.add(Item.output("c1", "b" * 20))
    h.add(Item("assistant", "c" * 10))
    assert h.chars == 30 + 6 + 2 + 20 + 10
    u2 = h.add(Item("user", "d" * 40))  # 108 > 100: the whole first turn goes, call and output with it
    assert h.items == [u2] and h.chars == 40
    for gone in (u1, call, out):
        with pytest.raises(UnknownItem):
            h.get(gone.id)
    big = h.add(Item("user", "e" * 500))  # the latest user turn stays, whatever its size
    assert h.items == [big] and h.chars == 500
    reply = h.add(Item("assistant", "f" * 50))
    assert h.items == [big, reply]

    # a client put a call's output in a later turn: when the call's turn goes, its output goes too
    h = History(max_chars=100)
    h.add(Item("user", "a" * 10))
    h.add(Item.call("c2", "lookup", "{}"))
    u2 = h.add(Item("user", "b" * 10))
    h.add(Item.output("c2", "late"))
    reply = h.add(Item("assistant", "c" * 10))
    u3 = h.add(Item("user", "d" * 70))
    assert h.items == [u2, reply, u3] and h.chars == 90
    assert all(m["role"] != "tool" for m in h.messages())


def test_delete_and_truncate_keep_the_running_total():
    h = History(max_chars=1_000)
    h.add(Item("user", "hello there"))
    said = h.add(Item("assistant", "One. Two. Three.", audio=True,
                      clauses=[(0, "One."), (24_000, "Two."), (48_000, "Three.")], audio_samples=72_000))
    h.truncate(said, 1_500)
    assert said.text == "One. Two." and h.chars == len("hello there") + len("One. Two.")
    h.delete(said.id)
    assert h.chars == len("hello there")
    h.add(Item("user", "x" * 990))  # 1001 > 1000: the first turn goes
    assert [it.text[:1] for it in h.items] == ["x"] and h.chars == 990


def test_max_items_still_bounds_and_keeps_whole_turns():
    h = History(max_items=5)
    for i in range(4):
        h.add(Item("user", f"q{i}"))
        h.add(Item("assistant", f"a{i}"))
    assert [it.text for it in h.items] == ["q2", "a2", "q3", "a3"]


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "64000"])
def test_max_history_chars_must_be_a_positive_integer(bad):
    with pytest.raises(ValueError, match="max_history_chars"):
        SessionConfig(max_history_chars=bad)
    assert SessionConfig().max_history_chars == 64_000
