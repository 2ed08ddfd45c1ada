"""The conversation core's limits on what one client may send, in-process (the same rules are driven
through the real app in tests/e2e/test_door.py): the reply rate, item sizes, the history's bound
for items of every kind, item audio on the audio allowance with its encodes one at a time, tool
sets' size and depth, the tool grammar compiled once per tool set, snapshot eviction by principal,
and a resumed live session leaving its older connection."""
from __future__ import annotations

import asyncio

import numpy as np
import pytest

from pipeline.conversation.agent import MAX_SCHEMA_DEPTH, MAX_TOOLS_CHARS, AgentSettings, BadSetting
from pipeline.conversation import Conversation, Refusal
from pipeline.conversation.history import MAX_ITEM_CHARS, History, Item
from pipeline.resume.tokens import SnapshotStore, new_token
from pipeline.adapters.v1.adapter import Session
from pipeline.session_config import SessionConfig
from tests.test_history_bound import FakeBackends, quiet


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def _conv(clock=None, backends=None, **settings) -> Conversation:
    cfg = SessionConfig(turn_detection="manual", barge_in="off", vad_events=False, pace_lead_s=None, **settings)
    return Conversation(quiet, backends or FakeBackends("Fine."), cfg, clock=clock or Clock())


def test_replies_asked_for_are_rate_limited_and_refill():
    clock = Clock()

    async def go():
        conv = _conv(clock, max_replies_per_minute=60, replies_burst=3)
        for i in range(3):
            await conv.user_turns.user_text(f"turn {i}")
            await conv.replies.reply.task
        with pytest.raises(Refusal) as refused:
            await conv.user_turns.respond()
        turns_before = conv.shared.turn
        with pytest.raises(Refusal):
            await conv.user_turns.user_text("one too many")
        assert conv.shared.turn == turns_before  # refused before anything happened
        clock.t += 1.0  # one reply a second comes back
        await conv.user_turns.respond()
        return refused.value

    refused = asyncio.run(go())
    assert refused.code == "rate_limited" and "60 replies a minute" in refused.message


def test_items_are_capped_and_an_assistant_flood_is_bounded():
    async def go():
        conv = _conv(max_history_chars=40_000)
        with pytest.raises(Refusal) as too_big:
            await conv.items.add(Item("assistant", "a" * (MAX_ITEM_CHARS + 1)))
        await conv.items.add(Item("user", "hello"))
        flood = [await conv.items.add(Item("assistant", f"{i} " + "b" * 15_000)) for i in range(20)]
        flood.append(await conv.items.add(Item.call("c1", "f", "{" + " " * 15_000 + "}")))
        return too_big.value, conv.shared.history, flood

    too_big, history, flood = asyncio.run(go())
    assert (too_big.code, too_big.param) == ("item_too_large", "item")
    assert history.items[0].text == "hello" and history.items[-1] is flood[-1]  # the user's message and the newest stay
    assert history.chars <= 40_000 + 2 * MAX_ITEM_CHARS
    assert flood[0] not in history.items  # the oldest went (only max_items bounded them before)


def test_a_single_user_turn_keeps_its_message_and_newest_item():
    h = History(max_chars=100)
    user = h.add(Item("user", "u" * 60))
    first = h.add(Item("assistant", "a" * 30))
    second = h.add(Item("assistant", "b" * 30))  # 120 > 100: the older assistant item goes
    assert h.items == [user, second] and first not in h.items and h.chars == 90


class EncodeBackends(FakeBackends):
    """Transcribes anything as "words"; each encode waits for the test to let it finish."""

    def __init__(self):
        super().__init__("Fine.")
        self.running = 0
        self.most = 0
        self.started = 0
        self.release = asyncio.Event()

    async def stt_open(self, sid, language=None):
        return None

    async def stt_push(self, sid, pcm):
        return []

    async def stt_finish(self, sid):
        return "words", []

    async def stt_close(self, sid):
        return None

    async def tts_encode(self, pcm, rate=16_000):
        self.running += 1
        self.started += 1
        self.most = max(self.most, self.running)
        try:
            await self.release.wait()
        finally:
            self.running -= 1
        return np.zeros((1, 32), np.int64)


def test_item_audio_pays_the_allowance_and_its_encodes_run_one_at_a_time():
    async def go():
        backends = EncodeBackends()
        conv = _conv(Clock(), backends, audio_burst_s=30.0, max_audio_rate=2.0, max_turn_s=20.0)
        second = np.zeros(16_000, np.int16)
        with pytest.raises(Refusal) as too_long:
            await conv.items.add_user_audio(np.concatenate([second] * 21))
        for _ in range(3):
            await conv.items.add_user_audio(np.concatenate([second] * 10))  # 30 s: the whole burst
        with pytest.raises(Refusal) as too_fast:
            await conv.items.add_user_audio(second)
        for _ in range(20):  # let every queued encode run as far as it can
            await asyncio.sleep(0)
        waiting = backends.started
        await conv.close()  # cancels the encode in progress and those queued behind it
        backends.release.set()
        for _ in range(20):
            await asyncio.sleep(0)
        return too_long.value, too_fast.value, backends, waiting, conv

    too_long, too_fast, backends, waiting, conv = asyncio.run(go())
    assert too_long.code == "turn_too_long" and too_fast.code == "audio_too_fast"
    assert waiting == 1 and backends.most == 1  # one at a time: the others wait their turn
    assert backends.started == 1 and not conv.shared.context.segments  # closed: none ran after, none joined the context


def _nested(depth: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


def test_tool_sets_are_capped_in_size_and_depth():
    agent = AgentSettings()
    ok = agent.updated({"tools": [{"type": "function", "name": "f", "parameters": _nested(4)}]}, ["default"])
    assert ok.tools[0]["name"] == "f"
    with pytest.raises(BadSetting, match=str(MAX_SCHEMA_DEPTH)):
        agent.updated({"tools": [{"type": "function", "name": "f", "parameters": _nested(400)}]}, ["default"])
    many = [{"type": "function", "name": f"t{i}", "description": "d" * 1000} for i in range(40)]
    with pytest.raises(BadSetting, match=str(MAX_TOOLS_CHARS)):
        agent.updated({"tools": many}, ["default"])


def test_a_tool_sets_grammar_is_compiled_once(monkeypatch):
    from pipeline.llm import constraint
    from pipeline.llm.tool_calls import forced_call_grammar

    llguidance = pytest.importorskip("llguidance")
    from transformers import AutoTokenizer  # noqa: F401 - the tiny tokenizer is built by the LLM config

    from pipeline.llm.engine import LLMEngine
    from pipeline.llm.config import LLMConfig

    engine = LLMEngine(LLMConfig.tiny())
    tok = engine._call_tokenizer()
    built = []
    real = llguidance.LLMatcher
    monkeypatch.setattr(constraint.llguidance, "LLMatcher", lambda *a, **k: built.append(1) or real(*a, **k))
    monkeypatch.setattr(constraint, "_templates", type(constraint._templates)())
    grammar = forced_call_grammar([{"type": "function", "name": "get_weather",
                                    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}])
    one, two = constraint.matcher_for(tok, grammar), constraint.matcher_for(tok, grammar)
    assert len(built) == 1 and one is not two
    first = int(np.flatnonzero(np.unpackbits(np.frombuffer(one.compute_bitmask(), np.uint8), bitorder="little"))[0])
    assert one.consume_token(first) and not one.is_error()
    assert not two.is_error() and two.compute_bitmask() != one.compute_bitmask()  # its own state


def test_snapshot_eviction_takes_from_the_principal_holding_the_most():
    store = SnapshotStore(max_entries=10)
    kept = []
    for i in range(3):
        token, digest = new_token(f"sess_b{i}", 0)
        assert store.put(f"sess_b{i}", 0, "token:bob", digest, b"bob")
        kept.append(token)
    for i in range(30):  # alice fills the store
        _, digest = new_token(f"sess_a{i}", 0)
        store.put(f"sess_a{i}", 0, "token:alice", digest, b"alice")
    assert len(store) == 10
    assert [store.take(t, "token:bob")[0] for t in kept] == [b"bob"] * 3  # bob's oldest survived alice's flood
    assert store.held_generation("sess_a29") == 0 and store.held_generation("sess_a0") is None


def test_a_live_session_resumed_on_another_replica_is_closed_there():
    """Resumed on replica two while its connection on replica one is still open: replica one's
    keeper finds the store past its generation at its next look and closes the older connection
    (session_replaced, 4001); the newer goes on."""
    from pipeline.adapters.v1 import protocol as P
    from pipeline.connection import Resumption, SessionRegistry, serve_connection
    from pipeline.resume.keeper import Continuity
    from pipeline.resume.tokens import LocalSnapshots
    from tests.test_session import FakeConnection

    cfg = SessionConfig(turn_detection="manual", barge_in="off", vad_events=False, pace_lead_s=None)
    snapshots = LocalSnapshots()
    continuity = Continuity(snapshots, window_s=1.5)  # the keeper looks every 0.5 s
    backends = FakeBackends("Fine.")
    one, two = SessionRegistry(4), SessionRegistry(4)

    def connect(registry, query=None):
        conn = FakeConnection()
        conn.served = asyncio.create_task(serve_connection(conn, backends, cfg, registry, Session,
                                                           resumption=Resumption(continuity, "p", query or {})))
        return conn

    async def go():
        old = connect(one)
        await old.rec.wait(lambda m: m["type"] == "session.ready", timeout=10)
        ready = old.rec.msgs[0]
        while snapshots.store.held_generation(ready["session_id"]) is None:  # its first snapshot is in
            await asyncio.sleep(0.05)
        new = connect(two, {"resume": ready["resume_token"]})
        await new.rec.wait(lambda m: m["type"] == "session.ready", timeout=10)
        await asyncio.wait_for(old.closed.wait(), 10)
        await asyncio.wait_for(old.served, 10)
        still = (len(one), len(two))
        new.leave()
        await asyncio.wait_for(new.served, 10)
        return old, new, still

    old, new, still = asyncio.run(go())
    assert old.close_code == P.CLOSE_SESSION_REPLACED
    assert [m["code"] for m in old.rec.msgs if m["type"] == "error"] == [P.E_SESSION_REPLACED]
    assert new.rec.msgs[0]["resumed"] is True and still == (0, 1)
