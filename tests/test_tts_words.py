"""A reply on a TTS that takes words (Kyutai's DSM, tiny, greedy, in-process): one utterance per
reply, its clauses fed as the LLM writes them (pipeline/conversation/synthesis.py), never a TTS
stream per clause, and no Mimi encode of the user's turns (DSM takes no context). The reply's
clause marks (where each clause's audio begins, kept in the history for a cut) are those the
engine gives the same clauses said to it directly; a session closed mid-reply frees its TTS row."""
from __future__ import annotations

import asyncio

import numpy as np
import pytest

from pipeline.adapters.v1 import protocol as P
from pipeline.adapters.v1.adapter import Session
from pipeline.audio import speech_like
from pipeline.llm.config import LLMConfig
from pipeline.runtime.compile_guard import CompileCounter
from pipeline.services import LLMService, LocalBackends, STTService, TTSService
from pipeline.session_config import SessionConfig
from pipeline.stt.config import STTConfig
from pipeline.tts.config import TTSConfig
from tests.test_session import Recorder

TTS = TTSConfig.tiny(family="dsm", num_slots=2, temperature=0.0)
REPLY = "Hello there, my friend. How are you today? I am fine, thank you, and the sea is calm."


@pytest.fixture(scope="module")
def engines():
    return LocalBackends.build(STTConfig.tiny(num_slots=2, endpoint_ms=None), LLMConfig.tiny(max_output_tokens=8), TTS)


class Scripted:
    """Real STT and TTS; an LLM that writes ``REPLY`` a word at a time (``gate``: it waits there
    before its last words until the test opens it); counts the TTS calls of each kind."""

    def __init__(self, engines, gate: asyncio.Event | None = None, hold_at: int = -3):
        b = engines  # fresh services: their asyncio state belongs to one event loop
        self.inner = LocalBackends(STTService(b.stt.engine, b.stt.thread), LLMService(b.llm.engine, b.llm.thread),
                                   TTSService(b.tts.engine, b.tts.thread))
        self.gate, self.hold_at = gate, hold_at % len(REPLY.split(" "))
        self.calls = {"tts_stream": 0, "tts_encode": 0, "tts_open": 0, "tts_feed": 0, "tts_close": 0}
        self.fed: list[list[tuple[str, bool]]] = []  # the pieces of each feed
        self.fed_one = asyncio.Event()

    def __getattr__(self, name):
        if name in self.calls:
            self.calls[name] += 1
        return getattr(self.inner, name)

    async def tts_feed(self, uid, pieces, final=False):
        self.calls["tts_feed"] += 1
        self.fed.append(list(pieces))
        self.fed_one.set()
        return await self.inner.tts_feed(uid, pieces, final)

    async def llm_stream(self, messages, sampling):
        words = REPLY.split(" ")
        for i, word in enumerate(words):
            if self.gate is not None and i == self.hold_at:
                await self.gate.wait()
            await asyncio.sleep(0)  # (a yield, as a stream's deltas come)
            yield word + (" " if i < len(words) - 1 else "")


def _session(rec, backends) -> Session:
    return Session(rec, backends, SessionConfig(turn_detection="manual", echo_cancellation=False,
                                                noise_reduction=None), voices=TTS.voice_names())


def test_a_reply_is_one_utterance_fed_clause_by_clause_with_its_clauses_marked(engines):
    """Also the turn-boundary stall's construction on this family (docs/stall.md): the user's turn
    is never encoded and nothing is compiled, whatever the lengths."""
    spy = Scripted(engines)
    pcm = speech_like(1.2, seed=5)
    counter = CompileCounter().install()
    compiled = counter.total

    async def go():
        rec = Recorder()
        s = _session(rec, spy)
        await s.start()
        for i in range(0, len(pcm), 1600):  # a spoken turn: no encode of it for a TTS without context
            await s.on_frame(P.client_audio(pcm[i : i + 1600]))
        await s.on_frame(P.client_turn_end())
        await rec.wait(lambda m: m["type"] == "response.done")
        item = [it for it in s.core.shared.history.items if it.role == "assistant"][-1]
        await s.close()
        return rec.msgs, item

    msgs, item = asyncio.run(go())
    assert counter.total == compiled
    assert spy.calls["tts_stream"] == 0 and spy.calls["tts_encode"] == 0 and spy.calls["tts_open"] == 1
    clauses = [text for _, text in item.clauses]
    assert len(clauses) >= 3 and " ".join(clauses) == REPLY and spy.calls["tts_feed"] > 1
    assert spy.calls["tts_close"] == 0  # it ended by itself
    pcm_out = np.concatenate([np.frombuffer(m["pcm"], "<i2") for m in msgs if m["type"] == "audio"])
    assert len(pcm_out) == item.audio_samples

    engine = engines.tts.engine  # the same clauses said to the engine directly: the same audio and marks
    ref = engines.tts.thread.call(_direct, engine, clauses)
    assert np.array_equal(pcm_out, np.concatenate([p for _, p in ref]))
    starts = np.cumsum([0] + [len(p) for _, p in ref])[:-1]
    assert [start for start, _ in item.clauses] == [int(st) for (mark, _), st in zip(ref, starts) if mark is not None]
    assert [mark for mark, _ in ref if mark is not None] == list(range(len(clauses)))


def _direct(engine, clauses: list[str]) -> list[tuple[int | None, np.ndarray]]:
    s = engine.open()
    for i, clause in enumerate(clauses):
        engine.say(s, clause, final=i == len(clauses) - 1)
    out = []
    while not s.finished:
        engine.step()
        while (item := s.take_marked()) is not None:
            out.append((item[0], item[1]))
    return out


def test_a_session_closed_mid_reply_frees_its_row(engines):
    gate = asyncio.Event()
    spy = Scripted(engines, gate)

    async def go():
        rec = Recorder()
        s = _session(rec, spy)
        await s.start()
        await s.on_frame(P.client_text("Tell me about the sea."))
        await rec.wait(lambda m: m["type"] == "audio")  # speaking; the LLM holds its last words
        held = engines.tts.engine.busy_slots
        await s.close()  # the client leaves mid-reply
        for _ in range(200):  # the row is freed on the inference thread, after the stream is closed
            if engines.tts.engine.active_requests == 0:
                break
            await asyncio.sleep(0.01)
        return held, engines.tts.engine.active_requests

    held, left = asyncio.run(go())
    assert (held, left) == (1, 0) and spy.calls["tts_close"] == 1


def test_the_tts_is_fed_the_first_words_before_the_first_clause_is_written(engines):
    """DSM starts on the first words: the LLM holds before the last word of its first clause, and
    the utterance has been fed the words before it, as the clause's beginning; the clause, once
    written, is the first of the reply's clauses, and the reply is spoken to its end."""
    gate = asyncio.Event()
    spy = Scripted(engines, gate, hold_at=3)  # "Hello there, my " written; "friend." held

    async def go():
        rec = Recorder()
        s = _session(rec, spy)
        await s.start()
        await s.on_frame(P.client_text("Hello?"))
        while True:  # until the words written so far have all been fed (the LLM holds the rest)
            spy.fed_one.clear()
            pieces = [p for feed in spy.fed for p in feed]
            if " ".join(t for t, _ in pieces) == "Hello there, my":
                break
            await asyncio.wait_for(spy.fed_one.wait(), 30)
        gate.set()
        await rec.wait(lambda m: m["type"] == "response.done")
        item = [it for it in s.core.shared.history.items if it.role == "assistant"][-1]
        await s.close()
        return pieces, item, rec.msgs

    pieces, item, msgs = asyncio.run(go())
    assert [begins for _, begins in pieces] == [True] + [False] * (len(pieces) - 1)  # one clause begun
    assert item.clauses[0] == (0, "Hello there, my friend.") and " ".join(t for _, t in item.clauses) == REPLY
    assert next(m for m in msgs if m["type"] == "response.done")["interrupted"] is False
