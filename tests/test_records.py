"""The call-record store (pipeline/records/store.py) and its keeper (pipeline/records/keeper.py):
bounded by count, bytes, age and record size; each record readable by its own principal only
(a phone call's by any token); a store that is slow or gone never holds up the conversation."""
from __future__ import annotations

import asyncio
import json

import pytest

from pipeline.records.keeper import RecordKeeper
from pipeline.records.store import CARRIER, NoRecord, RecordStore


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_record_is_its_principals_only_and_a_phone_calls_any_tokens():
    store = RecordStore()
    store.put("sess_a", "token:alice", b"{}")
    store.put("sess_phone", CARRIER, b"{}")
    assert store.get("sess_a", "token:alice") == b"{}"
    for asker in ("token:bob", "anyone", "ticket"):
        with pytest.raises(NoRecord) as refused:
            store.get("sess_a", asker)
        assert "sess_a" in str(refused.value)
    with pytest.raises(NoRecord):  # the same answer as for a session that never was
        store.get("sess_never", "token:alice")
    assert store.get("sess_phone", "token:bob") == b"{}"
    with pytest.raises(NoRecord):
        store.get("sess_phone", "anyone-else")
    assert not store.put("sess_a", "token:bob", b"[]")  # nobody overwrites another's record
    assert store.get("sess_a", "token:alice") == b"{}"


def test_the_store_is_bounded_by_count_bytes_age_and_size():
    clock = Clock()
    store = RecordStore(max_records=3, max_bytes=9, max_age_s=60, max_record_bytes=6, clock=clock)
    assert not store.put("big", "p", b"x" * 7) and len(store) == 0
    for i in range(4):
        clock.now += 1
        assert store.put(f"s{i}", "p", b"xx")
    assert len(store) == 3 and store.bytes == 6  # the least recently put went first
    with pytest.raises(NoRecord):
        store.get("s0", "p")
    store.put("s1", "p", b"xxxxxx")  # a put replaces, and moves the record to the back
    assert store.bytes == 8 and store.get("s1", "p") == b"xxxxxx"
    with pytest.raises(NoRecord):
        store.get("s2", "p")  # dropped for the bytes
    clock.now += 61
    with pytest.raises(NoRecord):
        store.get("s1", "p")
    assert len(store) == 0 and store.bytes == 0


class Record:
    session_id = "sess_x"

    def __init__(self):
        self.version = 0

    def as_dict(self) -> dict:
        return {"session_id": self.session_id, "version": self.version}


class Records:
    def __init__(self, stall: asyncio.Event | None = None):
        self.puts: list[dict] = []
        self.stall = stall

    async def put_record(self, session_id, principal, blob):
        if self.stall is not None:
            await self.stall.wait()
        self.puts.append(json.loads(blob))
        return True


def test_the_keeper_puts_a_changed_record_once_and_the_last_at_the_end():
    async def go():
        records, record = Records(), Record()
        keeper = RecordKeeper(records, record, "token:a", "v1")
        await keeper.put()
        await keeper.put()  # unchanged: not put again
        record.version = 3
        await keeper.finish()
        return records.puts

    puts = asyncio.run(go())
    assert [p["version"] for p in puts] == [0, 3] and puts[-1]["transport"] == "v1"


def test_a_store_that_does_not_answer_holds_up_nothing(monkeypatch):
    from pipeline.records import keeper as keeper_module

    monkeypatch.setattr(keeper_module, "STORE_TIMEOUT_S", 0.05)

    async def go():
        records = Records(stall=asyncio.Event())  # never set: the store does not answer
        keeper = RecordKeeper(records, Record(), "token:a", "v1")
        await asyncio.wait_for(keeper.finish(), 1.0)  # bounded, and it does not raise
        return keeper.failed_puts

    assert asyncio.run(go()) == 1


def test_a_resumed_session_continues_the_record_its_dropped_connection_left():
    from pipeline.conversation.call_record import CallRecord
    from pipeline.records.store import LocalRecords

    async def go():
        records, clock = LocalRecords(), Clock()
        first = CallRecord("sess_r", clock)
        first.turns.append({"turn": 1, "at_s": 0.5, "user": "hello", "replies": []})
        first.error("server_busy")
        clock.now = 10.0
        await RecordKeeper(records, first, "token:a", "v1").finish()
        resumed = CallRecord("sess_r", clock)  # the same session, on another connection
        resumed.turns.append({"turn": 2, "at_s": 0.0, "user": "again", "replies": []})
        await RecordKeeper(records, resumed, "token:a", "v1", resumed=True).finish()
        return json.loads(await records.get_record("sess_r", "token:a")), resumed

    rec, resumed = asyncio.run(go())
    assert [t["user"] for t in rec["turns"]] == ["hello", "again"]
    assert [e["code"] for e in rec["errors"]] == ["server_busy"]
    assert rec["duration_s"] == 10.0  # its clock goes on from the first connection's start
