"""STTService bookkeeping around the engine, with a stub engine and an inline "thread" whose
step results can be held back: the races between a batched step and a stream's end, made exact."""
from __future__ import annotations

import asyncio

import numpy as np
import pytest

from pipeline.services import stt as services_module
from pipeline.services import STTService
from pipeline.engines import UnknownStream
from pipeline.stt.engine import NoFreeSlot, STTEvent


class StubEngine:
    """Each step emits one partial for every open stream fed since the last step, and a final
    for every stream ended since the last step."""

    def __init__(self, num_slots: int = 64):
        self.num_slots = num_slots
        self._fed: dict[str, bool] = {}  # open streams: fed since the last step?
        self._ending: set[str] = set()
        self.ended = asyncio.Event()  # set by end()
        self.closed: list[str] = []

    @property
    def active_streams(self) -> list[str]:
        return list(self._fed)

    def open(self, sid: str, language=None) -> None:
        if sid in self._fed:
            raise ValueError(f"{sid} is already open")
        if len(self._fed) >= self.num_slots:
            raise NoFreeSlot("full")
        self._fed[sid] = False

    def close(self, sid: str) -> None:
        self._ending.discard(sid)
        if self._fed.pop(sid, None) is not None:
            self.closed.append(sid)

    def feed(self, sid: str, audio) -> None:
        self._fed[sid] = True

    def end(self, sid: str) -> None:
        self._ending.add(sid)
        self.ended.set()

    def pending(self) -> bool:
        return any(self._fed.values()) or bool(self._ending)

    def step(self) -> list[STTEvent]:
        due = [sid for sid, fed in self._fed.items() if fed]
        for sid in due:
            self._fed[sid] = False
        events = [STTEvent(sid, "partial", f"<{sid}>") for sid in due]
        if not due:  # an ended stream's final comes after its last chunk's step
            events += [STTEvent(sid, "final", f"<{sid} final>", [], []) for sid in sorted(self._ending)]
            self._ending.clear()
        return events


class HeldStepThread:
    """Runs engine calls inline, but can hold a step's result back after the step ran, as if it
    were still on its way from the inference thread while other calls go ahead."""

    def __init__(self):
        self.hold_next_step = False
        self.step_ran = asyncio.Event()
        self.release = asyncio.Event()

    async def run(self, fn, *args):
        result = fn(*args)
        if getattr(fn, "__name__", "") == "step" and self.hold_next_step:
            self.hold_next_step = False
            self.step_ran.set()
            await self.release.wait()
        return result


PCM = np.zeros(160, np.int16)


@pytest.mark.parametrize("end", ["close", "finish"])
def test_events_of_a_stream_ended_mid_step_are_dropped(end):
    """B's push steps A's chunk too; A's turn ends while that step's result is in flight. A's
    events must not be kept (a leak per turn), nor reach A's next turn. ``close`` returns while
    the step is in flight; ``finish`` marks the end then, and its final comes from a later step
    of the same drain."""

    async def go():
        engine, thread = StubEngine(), HeldStepThread()
        svc = STTService(engine, thread)
        assert await svc.open("a") is None and await svc.open("b") is None
        engine.feed("a", PCM)  # A has a chunk due
        thread.hold_next_step = True
        push_b = asyncio.create_task(svc.push("b", PCM))
        await asyncio.wait_for(thread.step_ran.wait(), 5)
        ending = asyncio.create_task(getattr(svc, end)("a"))
        if end == "close":
            ended = await asyncio.wait_for(ending, 5)
            thread.release.set()
        else:
            await asyncio.wait_for(engine.ended.wait(), 5)  # A's end is marked, its chunk's step in flight
            thread.release.set()
            ended = await asyncio.wait_for(ending, 5)
        events_b = await asyncio.wait_for(push_b, 5)
        kept = sorted(svc._outbox)
        await svc.open("a")  # A's next turn
        events_a = await svc.push("a", PCM)
        return ended, events_b, kept, events_a, engine.closed

    ended, events_b, kept, events_a, closed = asyncio.run(go())
    assert events_b == [{"kind": "partial", "text": "<b>"}]
    assert kept == ["b"]  # only open streams have an outbox
    assert events_a == [{"kind": "partial", "text": "<a>"}]  # its own step only, nothing stale
    assert closed == ["a"]  # finish gives the slot back too
    if end == "finish":
        assert ended == ("<a final>", [])


def test_close_is_idempotent_and_finish_frees_the_slot():
    async def go():
        engine = StubEngine()
        svc = STTService(engine, HeldStepThread())
        await svc.open("a")
        await svc.push("a", PCM)
        text = await svc.finish("a")
        after_finish = engine.active_streams
        await svc.close("a")
        await svc.close("a")
        return text, after_finish, engine.closed, dict(svc._outbox)

    text, after_finish, closed, outbox = asyncio.run(go())
    assert text == ("<a final>", []) and after_finish == [] and closed == ["a"] and outbox == {}


def test_unknown_stream_is_a_clear_error_and_counted():
    """A call for a stream this replica does not hold (never opened here, or already finished)
    raises UnknownStream, never a KeyError deep in the engine, and counts as a misroute."""
    counter = services_module.metrics.STT_UNKNOWN_STREAMS.labels(replica="r1")

    async def go():
        svc = STTService(StubEngine(), HeldStepThread(), replica="r1")
        before = counter._value.get()
        with pytest.raises(UnknownStream):
            await svc.push("never-opened", PCM)
        await svc.open("a")
        await svc.finish("a")
        with pytest.raises(UnknownStream):
            await svc.finish("a")
        return counter._value.get() - before

    assert asyncio.run(go()) == 2


def test_reopening_an_open_stream_restarts_it():
    """A session that gave up on a stream (its open timed out, say) opens the same id again:
    the old stream is closed, not an error, and one slot is held."""

    async def go():
        engine = StubEngine()
        svc = STTService(engine, HeldStepThread())
        await svc.open("a")
        await svc.push("a", PCM)
        reason = await svc.open("a")
        return reason, engine.active_streams, engine.closed

    assert asyncio.run(go()) == (None, ["a"], ["a"])


class Clock:
    def __init__(self):
        self.now = 100.0

    def monotonic(self) -> float:
        return self.now

    def perf_counter(self) -> float:
        return self.now


def test_abandoned_streams_give_their_slots_to_new_ones(monkeypatch):
    """Streams no call touched for stale_after_s (their sessions went to another replica) are
    closed when a new stream finds every slot taken; a stream still in use is kept."""
    clock = Clock()
    monkeypatch.setattr(services_module, "time", clock)

    async def go():
        engine = StubEngine(num_slots=2)
        svc = STTService(engine, HeldStepThread(), stale_after_s=30)
        await svc.open("old")
        await svc.open("busy")
        refused_fresh = await svc.open("new")  # nothing is stale yet: refused
        clock.now += 20
        await svc.push("busy", PCM)
        clock.now += 20  # "old" untouched for 40 s, "busy" for 20 s
        taken = await svc.open("new")
        return refused_fresh, taken, sorted(engine.active_streams), engine.closed

    refused_fresh, taken, active, closed = asyncio.run(go())
    assert refused_fresh == "full"
    assert taken is None and active == ["busy", "new"] and closed == ["old"]
