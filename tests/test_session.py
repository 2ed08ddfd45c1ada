"""The conversation loop on real tiny engines, in-process (no Ray): ordering, clause handoff,
interruption, STT slots per spoken turn, session limits and clean-up, observed through the
protocol messages and the engines' counters."""
from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

from pipeline.adapters.v1 import protocol as P
from pipeline.adapters.v1 import adapter as session_module
from pipeline.audio import speech_like
from pipeline.conversation.observer import Observer
from pipeline.connection import ClientGone, SessionRegistry, serve_connection
from pipeline.llm.config import LLMConfig
from tests.slow_llm import slowed
from pipeline.runtime.threads import InferenceThread
from pipeline.services import LLMService, LocalBackends, STTService, TTSService, load_stt
from pipeline.adapters.v1.adapter import Session
from pipeline.session_config import ReplicaLimits
from pipeline.session_config import SessionConfig as _SessionConfig
from pipeline.stt.config import STTConfig
from pipeline.tts.config import TTSConfig


def SessionConfig(**settings) -> _SessionConfig:
    """Push-to-talk sessions: these tests speak synthetic audio (no VAD calls it speech) and end
    turns with turn.end; barge-in by recognised words. Hands-free turns: test_turn_taking.py."""
    return _SessionConfig(**{"turn_detection": "manual", "barge_in": "words", **settings})


@pytest.fixture(scope="module")
def engines():
    # A deliberately slow LLM (20 ms per token) so that the reply outlasts its first clause.
    # No endpointing: on random weights a run of blanks comes by chance and would split turns.
    return slowed(LocalBackends.build(STTConfig.tiny(num_slots=4, endpoint_ms=None),
                               LLMConfig.tiny(max_output_tokens=40),
                               TTSConfig.tiny()), 0.02)


def _fresh(engines, stt: STTService | None = None) -> LocalBackends:
    """Fresh services (their asyncio locks belong to one event loop) over the loaded engines."""
    b = engines
    return LocalBackends(stt or STTService(b.stt.engine, b.stt.thread), LLMService(b.llm.engine, b.llm.thread),
                         TTSService(b.tts.engine, b.tts.thread))


@pytest.fixture
def backends(engines):
    return _fresh(engines)


@pytest.fixture(scope="module")
def one_slot_stt():
    """A recogniser with a single slot, so two speakers contend for it."""
    thread = InferenceThread("stt-one-slot")
    return thread.call(load_stt, STTConfig.tiny(num_slots=1, endpoint_ms=None)), thread


@pytest.fixture
def one_slot(engines, one_slot_stt):
    return _fresh(engines, STTService(*one_slot_stt))


class Recorder:
    def __init__(self):
        self.msgs: list[dict] = []
        self.times: list[float] = []  # arrival of each message (monotonic)
        self._arrived = asyncio.Condition()

    async def __call__(self, frame: bytes) -> None:
        self.msgs.append(P.unpack(frame))
        self.times.append(time.monotonic())
        async with self._arrived:
            self._arrived.notify_all()

    def turn(self, n):
        return [m for m in self.msgs if m.get("turn") == n]

    def errors(self):
        return [m["code"] for m in self.msgs if m["type"] == "error"]

    async def wait(self, pred, timeout=60):
        """Until a message satisfying ``pred`` has arrived (woken by each arrival)."""
        async with self._arrived:
            await asyncio.wait_for(self._arrived.wait_for(lambda: any(pred(m) for m in self.msgs)), timeout)


def _done(turn):
    return lambda m: m["type"] == "response.done" and m["turn"] == turn


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
    assert [h["role"] for h in s.core.shared.history.messages()] == ["user", "assistant", "user", "assistant"]
    assert s.core.shared.history.messages()[1]["content"] == "".join(m["text"] for m in rec.turn(1) if m["type"] == "response.text").strip()


def _past_first_clause(msgs: list[dict], max_words: int) -> bool:
    """The response.text in ``msgs`` goes on after its first clause (as the session splits it)."""
    from pipeline.conversation.clauses import ClauseSplitter

    text = "".join(m["text"] for m in msgs if m["type"] == "response.text")
    clauses = ClauseSplitter(max_words=max_words).push(text)
    return bool(clauses) and len(text.replace(" ", "")) > len(clauses[0].replace(" ", ""))


async def _playing_long_reply(backends, **cfg) -> tuple[Recorder, Session]:
    """A started, paced session whose first reply (a long story) has begun to play."""
    rec = Recorder()
    s = Session(rec, backends, SessionConfig(pace_lead_s=0.1, **cfg))
    await s.start()
    await s.on_frame(P.client_text("Tell me a long story."))
    await rec.wait(lambda m: m["type"] == "audio" and m["turn"] == 1)
    return rec, s


def test_interruption_truncates_history_and_stops_audio(backends):
    async def go():
        rec, s = await _playing_long_reply(backends)  # paced: the reply takes real time
        # Interrupt once the text sent runs past the first clause: the first clause plays for at least
        # min_frames (480 ms), so the second cannot have started yet and the reply must be cut.
        await rec.wait(lambda _: _past_first_clause(rec.turn(1), s.core.shared.cfg.clause_max_words))
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
    said = s.core.shared.history.messages()[1]["content"]
    assert s.core.shared.history.messages()[1]["role"] == "assistant" and said
    # truncated: the history keeps the clauses that had started playing, a proper prefix of the text sent
    assert len(said.replace(" ", "")) < len(full_reply.replace(" ", "")), (said, full_reply)
    assert full_reply.replace(" ", "").startswith(said.replace(" ", ""))
    assert rec.turn(2)[-1]["interrupted"] is False


async def _queued_work_done(*threads: InferenceThread) -> None:
    """Every call queued on these inference threads so far has run, and so has the clean-up those
    calls queued as they finished (a stream cancelled while it was being made is closed as soon as
    it exists: InferenceThread.open). Each thread runs its calls in order, so a no-op queued behind
    them returns after them; a second one is behind whatever the first's predecessors queued."""
    for thread in threads:
        for _ in range(2):
            await thread.run(lambda: None)


def test_close_mid_reply_leaves_nothing_running(backends):
    async def go():
        rec = Recorder()
        s = Session(rec, backends, SessionConfig(pace_lead_s=0.1))
        await s.start()
        await s.on_frame(P.client_text("Talk for a while, please."))
        await rec.wait(lambda m: m["type"] == "audio")
        await s.close()  # the reply's engine streams are closed; their clean-up is queued on the threads
        await _queued_work_done(backends.llm.thread, backends.tts.thread, backends.stt.thread)
        return backends.llm.stats(), backends.tts.stats(), backends.stt.stats()

    llm, tts, stt = asyncio.run(go())
    assert llm["active_requests"] == 0 and tts["active_requests"] == 0 and stt["active_streams"] == 0


async def _say(s, pcm, frame=1600):
    for i in range(0, len(pcm), frame):
        await s.on_frame(P.client_audio(pcm[i : i + frame]))


def test_barge_in_by_speech(backends):
    async def go():
        # No grace period (test_no_barge_in_during_the_grace_period covers it), so no waiting for one.
        rec, s = await _playing_long_reply(backends, barge_in_grace_s=0.0)
        # Text past the first clause has been sent, so the cut reply is a proper prefix of it.
        await rec.wait(lambda _: _past_first_clause(rec.turn(1), s.core.shared.cfg.clause_max_words))
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
    said = s.core.shared.history.messages()[1]["content"]
    full = "".join(m["text"] for m in rec.turn(1) if m["type"] == "response.text")
    assert said and full.replace(" ", "").startswith(said.replace(" ", "")) and len(said) < len(full)


def test_no_barge_in_during_the_grace_period(backends):
    """Words heard while the reply's first barge_in_grace_s of audio plays do not interrupt it. The
    grace period outlasts the test (60 s), so no clock has to be waited on."""
    async def go():
        rec, s = await _playing_long_reply(backends, barge_in_grace_s=60.0)
        await _say(s, speech_like(2.5, seed=11))  # the same speech that interrupts without a grace period
        await rec.wait(lambda m: m["type"] == "response.done" and m["turn"] == 1)
        await s.close()  # the spoken turn's partials are all this test needs of it
        return rec

    rec = asyncio.run(go())
    done1 = next(m for m in rec.turn(1) if m["type"] == "response.done")
    heard = [m for m in rec.turn(2) if m["type"] == "transcript.partial" and m["text"].strip()]
    assert done1["interrupted"] is False  # the reply played on to its end...
    # ...although the recogniser heard words while it was still playing
    assert heard and rec.msgs.index(heard[0]) < rec.msgs.index(done1), "no words heard during the reply"


def test_quiet_noise_does_not_barge_in(backends):
    async def go():
        rec, s = await _playing_long_reply(backends, barge_in_grace_s=0.0)
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


# ----------------------------------------------------------------------------- STT slots per spoken turn
def _active(b: LocalBackends) -> list[str]:
    return sorted(b.stt.engine.active_streams)


def test_slot_held_only_during_spoken_turn(backends):
    pcm = speech_like(1.5, seed=7)

    async def go():
        rec = Recorder()
        s = Session(rec, backends, SessionConfig(pace_lead_s=None))
        await s.start()
        held = {"connected": _active(backends)}
        await s.on_frame(P.client_text("Just typing."))
        await rec.wait(_done(1))
        held["typed"] = _active(backends)
        await s.on_frame(P.client_audio(pcm[:1600]))
        held["first audio"] = _active(backends)
        await _say(s, pcm[1600:])
        await s.on_frame(P.client_turn_end())  # returns once transcript.final is out
        held["turn ended"] = _active(backends)
        await rec.wait(_done(2))
        await _say(s, pcm)  # the same words again: a fresh recogniser state hears them the same
        await s.on_frame(P.client_turn_end())
        await rec.wait(_done(3))
        await _say(s, pcm[:3200])  # a turn the client leaves open
        held["left open"] = _active(backends)
        await s.close()
        held["closed"] = _active(backends)
        return rec, s.id, held

    rec, sid, held = asyncio.run(go())
    assert held == {"connected": [], "typed": [], "first audio": [sid], "turn ended": [],
                    "left open": [sid], "closed": []}
    final2, final3 = ([m["text"] for m in rec.turn(n) if m["type"] == "transcript.final"][0] for n in (2, 3))
    assert final2 and final2 == final3
    assert rec.errors() == []


class Counted(Observer):
    """An observer that hands each error code it hears to ``on_error``."""

    def __init__(self, on_error):
        self.on_error = on_error

    def error(self, code: str) -> None:
        self.on_error(code)


class FakeClock:
    """Stands in for the ``time`` module inside pipeline.adapters.v1.adapter: time moves only when told."""

    def __init__(self):
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now


def test_refused_turn_gets_no_free_slot_and_session_keeps_working(one_slot, monkeypatch):
    """One slot, two speakers: the second is told once, stays open, types, and is heard once the
    slot frees and its retry interval (1 s, on a fake clock) has passed."""
    clock = FakeClock()
    monkeypatch.setattr(session_module, "time", clock)
    speech = speech_like(1.5, seed=21)

    async def go():
        rec_a, rec_b = Recorder(), Recorder()
        a = Session(rec_a, one_slot, SessionConfig(pace_lead_s=None), session_id="a")
        b = Session(rec_b, one_slot, SessionConfig(pace_lead_s=None), session_id="b")
        await a.start()
        await b.start()
        await _say(a, speech[:8000])  # A speaks: it holds the only slot
        await _say(b, speech[:8000])  # five frames from B, all refused
        seen = {"b refused": (rec_b.errors(), _active(one_slot))}
        n_msgs = len(rec_b.msgs)
        await b.on_frame(P.client_turn_end())  # ends the refused turn: nothing is sent
        seen["refused turn.end"] = rec_b.msgs[n_msgs:]
        await b.on_frame(P.client_text("Typed while the recogniser is full."))
        await rec_b.wait(_done(1))
        await _say(b, speech[:3200])  # a new spoken turn, refused again: told again
        seen["second refusal"] = rec_b.errors()
        clock.now += 1.0
        await _say(b, speech[:1600])  # a second later B's turn asks again: still full, not told again
        seen["failed retry"] = (rec_b.errors(), _active(one_slot))
        await a.on_frame(P.client_turn_end())  # A's turn ends: the slot is free
        seen["a ended"] = _active(one_slot)
        clock.now += 0.5
        await _say(b, speech[:1600])  # too soon after the last refusal: still dropped
        seen["too soon"] = _active(one_slot)
        clock.now += 0.5
        await _say(b, speech)  # a second after it: B's turn takes the slot from here on
        seen["retried"] = _active(one_slot)
        await b.on_frame(P.client_turn_end())
        await rec_b.wait(_done(2))
        await rec_a.wait(_done(1))
        seen["b errors"] = rec_b.errors()
        await a.close()
        await b.close()
        seen["closed"] = _active(one_slot)
        return rec_a, rec_b, seen

    rec_a, rec_b, seen = asyncio.run(go())
    assert seen["b refused"] == ([P.E_NO_FREE_SLOT], ["a"])
    assert seen["refused turn.end"] == []
    assert [m["text"] for m in rec_b.turn(1) if m["type"] == "transcript.final"] == ["Typed while the recogniser is full."]
    assert rec_b.turn(1)[-1]["type"] == "response.done"
    assert seen["second refusal"] == [P.E_NO_FREE_SLOT] * 2
    assert seen["failed retry"] == ([P.E_NO_FREE_SLOT] * 2, ["a"])
    assert seen["a ended"] == [] and seen["too soon"] == [] and seen["retried"] == ["b"]
    assert seen["b errors"] == [P.E_NO_FREE_SLOT] * 2  # the retried turn was not told again
    final_b2 = [m for m in rec_b.turn(2) if m["type"] == "transcript.final"]
    assert len(final_b2) == 1 and final_b2[0]["text"]  # heard: turn 2, the refused turns used no number
    assert max(w["end_ms"] for w in final_b2[0]["words"]) <= 1500 + 80  # times from the recognised audio
    assert [m["type"] for m in rec_a.turn(1)][-1] == "response.done" and rec_a.errors() == []
    assert seen["closed"] == []


# ----------------------------------------------------------------------------- session limits
class EncodeSpy(SpyBackends):
    """Also records the length of each user turn's audio handed to the TTS context."""

    def __init__(self, inner):
        super().__init__(inner)
        self.encoded_samples: list[int] = []

    async def tts_encode(self, pcm):
        self.encoded_samples.append(len(pcm))
        return await super().tts_encode(pcm)


def test_max_turn_s_ends_a_long_turn(backends):
    spy = EncodeSpy(backends)
    speech = speech_like(2.6, seed=5)

    async def go():
        rec = Recorder()
        # no barge-in: turn 2 must not cancel turn 1's reply before its audio is encoded
        s = Session(rec, spy, SessionConfig(pace_lead_s=None, max_turn_s=2.0, barge_in=False))
        await s.start()
        buffered = []
        for i in range(0, len(speech), 4800):  # 0.3 s frames: the seventh crosses 2 s
            await s.on_frame(P.client_audio(speech[i : i + 4800]))
            buffered.append(sum(len(a) for a in s.core.turns.user_turn.audio))
        held_after_cap = _active(backends)
        await s.on_frame(P.client_turn_end())
        await rec.wait(_done(2))
        await s.close()
        return rec, s.id, buffered, held_after_cap

    rec, sid, buffered, held_after_cap = asyncio.run(go())
    assert max(buffered) <= 32000  # the turn's buffered audio never exceeds max_turn_s
    types = [m["type"] for m in rec.msgs]
    i_err = types.index("error")
    assert rec.msgs[i_err]["code"] == P.E_TURN_TOO_LONG and rec.errors() == [P.E_TURN_TOO_LONG]
    final1 = [m for m in rec.turn(1) if m["type"] == "transcript.final"][0]
    assert i_err < rec.msgs.index(final1)  # the error comes before the turn's transcript
    assert not any(m.get("turn") == 1 and m["type"] == "transcript.partial" for m in rec.msgs[i_err:])
    assert all(w["end_ms"] <= 2000 + 80 for w in final1["words"])
    assert spy.encoded_samples[0] == 32000  # exactly 2 s of the turn reached its reply's context
    assert held_after_cap == [sid]  # the frame's remaining 0.1 s, and what followed, opened turn 2
    assert spy.encoded_samples[1] == len(speech) - 32000
    assert [m["type"] for m in rec.turn(2)][-1] == "response.done"


class FakeConnection:
    """An in-memory client for pipeline.connection: frames queued by the test, replies recorded."""

    def __init__(self):
        self.inbox: asyncio.Queue = asyncio.Queue()
        self.rec = Recorder()
        self.close_code: int | None = None
        self.closed = asyncio.Event()
        self.closed_at = 0.0

    async def receive(self):
        return await self.inbox.get()

    async def send(self, frame: bytes) -> None:
        await self.rec(frame)

    async def close(self, code: int, reason: str) -> None:
        self.close_code, self.closed_at = code, time.monotonic()
        self.closed.set()

    def leave(self) -> None:
        self.inbox.put_nowait(None)


def test_silent_client_mid_turn_is_ended_by_max_turn(backends):
    """max_turn_s also counts wall-clock time with the slot held: a client that stops sending
    mid-turn gives its slot back without sending turn.end."""

    async def go():
        conn = FakeConnection()
        registry = SessionRegistry(4)
        served = asyncio.create_task(serve_connection(conn, backends, SessionConfig(pace_lead_s=None, max_turn_s=1.0),
                                                      registry, Session))
        conn.inbox.put_nowait(P.client_audio(speech_like(0.3, seed=2)))
        await conn.rec.wait(lambda m: m["type"] == "error", timeout=30)
        await conn.rec.wait(_done(1))
        held = _active(backends)
        conn.leave()
        await asyncio.wait_for(served, 30)
        return conn, held, len(registry)

    conn, held, registered = asyncio.run(go())
    types = [m["type"] for m in conn.rec.msgs]
    assert conn.rec.errors() == [P.E_TURN_TOO_LONG]
    assert types.index("error") < types.index("transcript.final")
    assert held == [] and registered == 0 and conn.close_code is None  # the session stayed open


def test_idle_timeout_closes_a_quiet_session_after_its_reply(backends):
    idle_s = 0.3  # the slow LLM (20 ms a token, 40 tokens) replies for longer than this

    async def go():
        conn = FakeConnection()
        registry = SessionRegistry(4)
        cfg = SessionConfig(pace_lead_s=None, idle_timeout_s=idle_s)
        served = asyncio.create_task(serve_connection(conn, backends, cfg, registry, Session))
        conn.inbox.put_nowait(P.client_text("Tell me a long story."))
        await asyncio.wait_for(conn.closed.wait(), 30)
        await asyncio.wait_for(served, 30)
        return conn, len(registry)

    conn, registered = asyncio.run(go())
    msgs, times = conn.rec.msgs, conn.rec.times
    assert [m["type"] for m in msgs][-2:] == ["response.done", "error"]  # the reply ran to its end
    assert msgs[-2]["interrupted"] is False and msgs[-1]["code"] == P.E_IDLE_TIMEOUT
    assert times[-2] - times[0] > idle_s  # the reply itself lasted longer than the idle limit
    assert conn.closed_at - times[-2] >= idle_s  # closed only after idle_s of silence
    assert conn.close_code == P.CLOSE_NORMAL and registered == 0


def test_server_busy_over_max_sessions(backends):
    """The connection over the cap is refused before it costs anything; the others go on."""
    spy = SpyBackends(backends)
    opened: list[str] = []

    async def stt_open(sid, language=None):
        opened.append(sid)
        await backends.stt_open(sid, language)

    spy.stt_open = stt_open

    async def go():
        registry = SessionRegistry(2)
        cfg = SessionConfig(pace_lead_s=None)
        conns = [FakeConnection() for _ in range(4)]
        tasks = [asyncio.create_task(serve_connection(c, spy, cfg, registry, Session)) for c in conns[:3]]
        await asyncio.wait_for(tasks[2], 10)  # the third returns at once: refused
        for c in conns[:2]:
            await c.rec.wait(lambda m: m["type"] == "session.ready")
        registered_at_cap = len(registry)
        conns[1].inbox.put_nowait(P.client_text("Still here?"))
        await conns[1].rec.wait(_done(1))
        conns[0].leave()
        await asyncio.wait_for(tasks[0], 10)
        tasks.append(asyncio.create_task(serve_connection(conns[3], spy, cfg, registry, Session)))
        await conns[3].rec.wait(lambda m: m["type"] == "session.ready")
        for c, t in ((conns[1], tasks[1]), (conns[3], tasks[3])):
            c.leave()
            await asyncio.wait_for(t, 10)
        return conns, registered_at_cap, len(registry)

    conns, registered_at_cap, registered_after = asyncio.run(go())
    refused = conns[2]
    assert [(m["type"], m.get("code")) for m in refused.rec.msgs] == [("error", P.E_SERVER_BUSY)]
    assert refused.close_code == P.CLOSE_TRY_AGAIN_LATER
    # no STT slot for anyone (slots are per spoken turn), no session for the refused one
    assert registered_at_cap == 2 and opened == []
    assert conns[1].rec.errors() == [] and conns[1].rec.turn(1)[-1]["type"] == "response.done"
    assert conns[3].rec.msgs[0]["type"] == "session.ready"  # a place freed: admitted again
    assert registered_after == 0


def test_session_limits_must_be_positive():
    for name in ("idle_timeout_s", "max_turn_s"):
        with pytest.raises(ValueError, match=name):
            SessionConfig(**{name: 0})
    for name in ("max_sessions", "max_sessions_per_client", "handshakes_per_minute"):  # the replica's
        with pytest.raises(ValueError, match=name):
            ReplicaLimits(**{name: 0})


# ----------------------------------------------------------------------------- engines that fail
class FailingBackends(SpyBackends):
    """Real backends whose chosen calls hang, as a replica that died unseen or stopped answering:
    ``stall`` names the Backends methods that never answer; a TTS stream hangs after one chunk."""

    def __init__(self, inner):
        super().__init__(inner)
        self.stall: set[str] = set()

    async def _hang(self):
        await asyncio.Event().wait()

    async def stt_push(self, sid, pcm):
        if "stt_push" in self.stall:
            await self._hang()
        return await self.inner.stt_push(sid, pcm)

    async def tts_stream(self, text, context):
        n = 0
        async for item in self.inner.tts_stream(text, context):
            if n and "tts_stream" in self.stall:
                await self._hang()
            n += 1
            yield item


def _finals(rec, turn):
    return [m["text"] for m in rec.turn(turn) if m["type"] == "transcript.final"]


def test_stalled_engines_give_engine_unavailable_and_the_session_goes_on(backends, monkeypatch):
    """A recogniser that stops answering mid-turn: one engine_unavailable (not one per frame, not
    internal), the turn's audio is lost and uses no turn number; a second later the next words
    are heard from a fresh state. A TTS that stops mid-reply: engine_unavailable, then
    response.done; the next turn is answered in full. The session never closes."""
    clock = FakeClock()
    monkeypatch.setattr(session_module, "time", clock)
    speech = speech_like(1.5, seed=31)
    failing = FailingBackends(backends)
    cfg = SessionConfig(pace_lead_s=None, engine_timeout_s=3.0)  # far above a real step here

    async def go():
        reference = Recorder()  # the same words in an undisturbed session
        r = Session(reference, backends, cfg, session_id="reference")
        await r.start()
        await _say(r, speech)
        await r.on_frame(P.client_turn_end())
        await reference.wait(_done(1))
        await r.close()

        rec = Recorder()
        s = Session(rec, failing, cfg, session_id="s")
        await s.start()
        await _say(s, speech[:8000])
        failing.stall.add("stt_push")
        await _say(s, speech[8000:16000])  # the first of these frames times out; the rest are dropped
        seen = {"stt lost": rec.errors()}
        failing.stall.discard("stt_push")
        await s.on_frame(P.client_turn_end())  # ends the lost turn: nothing to answer
        seen["lost turn.end"] = [m["type"] for m in rec.msgs if m["type"] != "error" and m["type"] != "session.ready"]
        clock.now += 1.0
        await _say(s, speech)  # a second later: a slot again, from a fresh recogniser state
        await s.on_frame(P.client_turn_end())
        await rec.wait(_done(1))
        failing.stall.add("tts_stream")
        await s.on_frame(P.client_text("Tell me a long story, please."))
        await rec.wait(_done(2))
        failing.stall.discard("tts_stream")
        await s.on_frame(P.client_text("And another one."))
        await rec.wait(_done(3))
        seen["closed"] = s.closed
        await s.close()
        return reference, rec, seen

    reference, rec, seen = asyncio.run(go())
    assert seen["stt lost"] == [P.E_ENGINE_UNAVAILABLE]
    assert seen["lost turn.end"] == []
    assert _finals(rec, 1) == _finals(reference, 1) and _finals(rec, 1)[0]
    turn2 = [m["type"] for m in rec.turn(2)]
    assert turn2.count("audio") == 1 and turn2[-1] == "response.done"  # one chunk came, then the TTS hung
    assert rec.turn(2)[-1]["interrupted"] is False
    assert rec.errors() == [P.E_ENGINE_UNAVAILABLE, P.E_ENGINE_UNAVAILABLE]
    i_err = [k for k, m in enumerate(rec.msgs) if m["type"] == "error"][1]
    assert rec.msgs[i_err + 1] == rec.turn(2)[-1]  # the error, then the reply's done
    turn3 = [m["type"] for m in rec.turn(3)]
    assert turn3.count("audio") > 1 and turn3[-1] == "response.done" and rec.turn(3)[-1]["interrupted"] is False
    assert seen["closed"] is False


class MovingBackends(SpyBackends):
    """The turn's stream 'moves' (its routing key now maps to another STT replica) just before
    push number ``move_at`` (or before finish): the replica that gets the call does not hold it."""

    def __init__(self, inner, move_at):
        super().__init__(inner)
        self.move_at = move_at
        self.pushes = 0

    async def _move(self, sid):
        await self.inner.stt.close(sid)  # the replica now asked has never seen this stream

    async def stt_push(self, sid, pcm):
        self.pushes += 1
        if self.pushes == self.move_at:
            await self._move(sid)
        return await self.inner.stt_push(sid, pcm)

    async def stt_finish(self, sid):
        if self.move_at == "finish":
            self.move_at = None  # it moves once
            await self._move(sid)
        return await self.inner.stt_finish(sid)


@pytest.mark.parametrize("move_at", [14, "finish"])  # 14: after the first partial
def test_a_moved_stream_restarts_its_turn_with_the_same_transcript(backends, move_at):
    """UnknownStream from the recogniser: the session opens the stream again and replays the
    turn's audio; the final transcript equals an undisturbed session's, with no error."""
    from pipeline import metrics

    speech = speech_like(1.5, seed=32)
    cfg = SessionConfig(pace_lead_s=None)
    unknown = metrics.STT_UNKNOWN_STREAMS.labels(replica="")

    async def say(b, sid):
        rec = Recorder()
        s = Session(rec, b, cfg, session_id=sid)
        await s.start()
        await _say(s, speech)
        await s.on_frame(P.client_turn_end())
        await rec.wait(_done(1))
        await s.close()
        return rec

    async def go():
        reference = await say(backends, "reference")
        before = unknown._value.get()
        moved = await say(MovingBackends(backends, move_at), "moved")
        return reference, moved, unknown._value.get() - before, _active(backends)

    reference, moved, misses, active = asyncio.run(go())
    assert _finals(moved, 1) == _finals(reference, 1) and _finals(moved, 1)[0]
    assert moved.errors() == []
    assert misses == 1  # the replica saw one call for a stream it did not hold
    last_partial = [[m["text"] for m in rec.turn(1) if m["type"] == "transcript.partial"][-1] for rec in (reference, moved)]
    assert last_partial[0] == last_partial[1]  # the replay rebuilt the partial, not appended to it
    assert active == []


# ----------------------------------------------------------------------------- the door's limits (issue 25)
def test_a_push_timeout_frees_the_stt_slot_at_once(backends):
    """A recogniser push that does not answer within engine_timeout_s: the turn's stream is closed
    on the replica at once (its slot free for others), not left to the replica's 120 s sweep, and
    not leaked when the session ends."""
    failing = FailingBackends(backends)
    speech = speech_like(1.0, seed=41)

    async def go():
        rec = Recorder()
        s = Session(rec, failing, SessionConfig(pace_lead_s=None, engine_timeout_s=0.5), session_id="stalled")
        await s.start()
        await _say(s, speech[:3200])
        held = {"speaking": _active(backends)}
        failing.stall.add("stt_push")
        await s.on_frame(P.client_audio(speech[3200:4800]))  # times out after 0.5 s
        await s.core.turns.recogniser.wait_closed()
        held["timed out"] = _active(backends)
        failing.stall.discard("stt_push")
        await s.close()
        held["closed"] = _active(backends)
        return rec, held

    rec, held = asyncio.run(go())
    assert held == {"speaking": ["stalled"], "timed out": [], "closed": []}
    assert rec.errors() == [P.E_ENGINE_UNAVAILABLE]


def test_audio_faster_than_twice_real_time_is_refused_and_dropped(backends, monkeypatch):
    """A client pushing microphone audio at 20x real time: past its burst allowance it gets one
    audio_too_fast, its frames are dropped (the recogniser sees at most burst + 2x the elapsed
    time), and it is heard again once it slows down. A session beside it is answered in full."""
    clock = FakeClock()
    monkeypatch.setattr(session_module, "time", clock)
    speech = speech_like(1.0, seed=43)
    pushed: dict[str, int] = {}

    class Counting(SpyBackends):
        async def stt_push(self, sid, pcm):
            pushed[sid] = pushed.get(sid, 0) + len(pcm)
            return await self.inner.stt_push(sid, pcm)

    counting = Counting(backends)
    cfg = SessionConfig(pace_lead_s=None, audio_burst_s=2.0, max_audio_rate=2.0)

    async def go():
        rec, witness = Recorder(), Recorder()
        s = Session(rec, counting, cfg, session_id="fast")
        w = Session(witness, counting, cfg, session_id="witness")
        await s.start()
        await w.start()
        await w.on_frame(P.client_text("Tell me about the weather."))
        for k in range(60):  # 6 s of audio in 0.3 s of the session's time: 20x real time
            await s.on_frame(P.client_audio(speech[(k % 10) * 1600:(k % 10 + 1) * 1600]))
            clock.now += 0.005
        seen = {"errors": rec.errors(), "pushed_s": pushed.get("fast", 0) / 16000}
        clock.now += 5.0  # it stopped for a while: audio at real time is heard again
        await s.on_frame(P.client_audio(speech[:1600]))
        seen["after"] = pushed["fast"] / 16000
        await s.on_frame(P.client_turn_end())
        await rec.wait(_done(1))
        await witness.wait(_done(1))
        await s.close()
        await w.close()
        return rec, witness, seen

    rec, witness, seen = asyncio.run(go())
    assert seen["errors"] == [P.E_AUDIO_TOO_FAST]  # told once, not once per frame
    assert 2.0 <= seen["pushed_s"] <= 2.0 + 2 * 0.3 + 0.1  # the burst and what 0.3 s of refill allows
    assert seen["after"] == pytest.approx(seen["pushed_s"] + 0.1)
    assert witness.errors() == [] and any(m["type"] == "audio" for m in witness.turn(1))
    assert rec.errors() == [P.E_AUDIO_TOO_FAST]


def test_a_client_gone_mid_reply_is_no_error(backends, caplog):
    """The client leaves while its reply's audio is being sent: the reply ends quietly, with no
    internal error counted or logged (a departure is not a server fault)."""
    counted: list[str] = []

    async def go():
        sent = {"audio": 0}

        async def send(frame: bytes) -> None:
            if P.unpack(frame)["type"] == "audio":
                sent["audio"] += 1
                if sent["audio"] == 2:
                    raise ClientGone()

        s = Session(send, backends, SessionConfig(pace_lead_s=None), observer=Counted(counted.append))
        await s.start()
        await s.on_frame(P.client_text("Tell me a long story, please."))
        await s.core.replies.reply.task
        reply = s.core.replies.reply
        await s.close()
        return reply

    with caplog.at_level("WARNING"):
        reply = asyncio.run(go())
    assert (reply.status, reply.reason) == ("failed", "client_gone")
    assert counted == []
    assert [r for r in caplog.records if r.levelname in ("ERROR", "CRITICAL")] == []


def test_a_busy_tts_is_server_busy_and_the_session_goes_on(backends):
    """Every TTS slot taken and its waiting line full (TTSBusyError, which through Ray arrives as
    an instance of itself): the reply ends with server_busy, not internal; the next is answered."""
    from pipeline.tts.engine import TTSBusyError

    class Busy(SpyBackends):
        busy = True

        async def tts_stream(self, text, context):
            if self.busy:
                raise TTSBusyError("all 1 TTS slots are busy and 4 streams wait")
            async for item in self.inner.tts_stream(text, context):
                yield item

    busy = Busy(backends)

    async def go():
        rec = Recorder()
        s = Session(rec, busy, SessionConfig(pace_lead_s=None))
        await s.start()
        await s.on_frame(P.client_text("Hello there."))
        await rec.wait(_done(1))
        busy.busy = False
        await s.on_frame(P.client_text("Hello again."))
        await rec.wait(_done(2))
        await s.close()
        return rec

    rec = asyncio.run(go())
    assert rec.errors() == [P.E_SERVER_BUSY]
    assert any(m["type"] == "audio" for m in rec.turn(2))
