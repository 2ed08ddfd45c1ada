"""Preemptive generation: a hands-free turn's reply starts in a lull, on the transcript so far,
while the pause grows and Smart Turn decides whether the turn is over.

Once the user has been silent ``preemptive_silence_ms`` (a lull), the recogniser ends a copy of
the turn's stream (the transcript the turn would end with now), and a :class:`Speculation` runs
the LLM on the prompt that transcript would make, keeping what it writes; once the LLM has written
the reply's first clause, it is spoken ahead (``pipeline/conversation/presynthesis.py``) with the
user's audio so far encoded into the TTS context. Nothing of it reaches the client: if the turn
ends with no speech since the lull and Smart Turn's verdict, its transcript is the lull's, and a
reply whose prompt (history, instructions, tools and that transcript) is exactly the speculated
one takes the speculation's LLM stream (:meth:`Speculation.stream`) and first clause; if the user
speaks on, the turn ends with another transcript, or anything else changes, the speculation is
cancelled and its streams closed, so it costs nothing more than the work done so far. What it
holds is bounded by the LLM's reply length and one clause's audio.
"""
from __future__ import annotations

import asyncio
import contextlib
from typing import AsyncIterator, Callable

import numpy as np

from pipeline.conversation.clauses import ClauseSplitter
from pipeline.conversation.ears.hearing import Recogniser
from pipeline.conversation.presynthesis import FirstClause, Kept
from pipeline.conversation.shared import Shared
from pipeline.engines import ToolCall, bounded_stream, takes_words

# Outcomes, for the metrics: the reply used it; the turn ended with another prompt; the user spoke
# on (or the turn was dropped) before it ended.
HIT, MISS, CANCELLED = "hit", "miss", "cancelled"


class Speculation:
    """One reply started ahead of a turn's end: the LLM on ``messages`` with ``sampling``, its
    first clause handed to ``speak`` (which starts it ahead, or gives None), and ``codes``: the
    user's audio so far being encoded for the TTS context (handed to the context on a hit)."""

    def __init__(self, llm: AsyncIterator, messages: list[dict], sampling, timeout_s: float,
                 speak: Callable[[str], FirstClause] | None = None, max_words: int = 12,
                 codes: asyncio.Task | None = None):
        self.messages, self.sampling, self.codes = messages, sampling, codes
        self.first: FirstClause | None = None  # the first clause, spoken ahead
        self._kept = Kept()  # deltas so far (bounded by the LLM's reply length)
        self.deltas = 0  # how many the LLM made (the work a miss wasted)
        splitter = ClauseSplitter(max_words=max_words) if speak is not None else None
        self._task = asyncio.create_task(self._run(llm, timeout_s, speak, splitter), name="speculation")

    async def _run(self, llm: AsyncIterator, timeout_s: float, speak, splitter: ClauseSplitter | None) -> None:
        try:
            async with contextlib.aclosing(bounded_stream(llm, timeout_s)) as deltas:
                async for delta in deltas:
                    self.deltas += 1
                    self._kept.put(delta)
                    if splitter is not None and isinstance(delta, ToolCall):
                        splitter = None  # the reply says what came before a call itself
                    elif splitter is not None and isinstance(delta, str) and delta:
                        if clauses := splitter.push(delta):  # as the reply will split it
                            self.first, splitter = speak(clauses[0]), None
            if splitter is not None and (clauses := splitter.flush()):
                self.first = speak(clauses[0])
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # noqa: BLE001 - handed to the reply that takes it, as its own LLM would
            self._kept.put(exc)
        self._kept.end()

    def matches(self, messages: list[dict], sampling) -> bool:
        return messages == self.messages and sampling == self.sampling

    async def stream(self):
        """What the LLM wrote so far, then the rest as it comes (an LLM stream, for the reply that
        takes it). Closing it early cancels the LLM."""
        try:
            async for delta in self._kept.items():
                yield delta
        finally:
            await self.cancel()

    async def cancel(self) -> None:
        """Stop the LLM and an encode not handed on (their streams are closed before this returns)."""
        tasks = [t for t in (self._task, self.codes) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def drop(self) -> None:
        """Not taken: stop all of it, the first clause too."""
        await self.cancel()
        if self.first is not None:
            await self.first.cancel()

    def take_codes(self) -> asyncio.Task | None:
        """The user's audio encode, handed to the TTS context (it is no longer this one's to cancel)."""
        codes, self.codes = self.codes, None
        return codes


class Speculator:
    """One conversation's replies started ahead: at most one at a time, the transcript of the last
    lull, and their outcomes so far. ``recogniser()``: the conversation's recogniser now."""

    def __init__(self, shared: Shared, recogniser: Callable[[], Recogniser]):
        self.shared, self.recogniser = shared, recogniser
        self.current: Speculation | None = None
        self.peeked: tuple[str, tuple[str, list[dict]] | None] | None = None  # (turn's item id, its transcript)
        self.outcomes: dict[str, int] = {}  # hit, miss, cancelled so far (for tests and tools)

    async def foresee(self, item_id: str, audio: np.ndarray) -> None:
        """A lull in the open spoken turn ``item_id`` (``audio`` so far): the transcript it would end
        with now, and a reply to it started ahead."""
        finished = await self.recogniser().peek()
        self.peeked = (item_id, finished)
        text = finished[0].strip() if finished is not None else ""
        if not text:
            await self.drop(CANCELLED)
            return
        agent = self.shared.agent
        await self.start(agent.messages(self.shared.history.messages() + [{"role": "user", "content": text}]),
                         agent.sampling(), text, audio)

    def transcript(self, item_id: str) -> tuple[str, list[dict]] | None:
        """The turn's transcript as the last lull had it (the user has not spoken since), if any."""
        return self.peeked[1] if self.peeked is not None and self.peeked[0] == item_id else None

    async def speaking_on(self) -> None:
        """The user speaks on: the lull's transcript and reply are no more."""
        self.peeked = None
        await self.drop(CANCELLED)

    async def start(self, messages: list[dict], sampling, text: str = "", audio: np.ndarray | None = None) -> None:
        """Start the LLM on this prompt, replacing one started on another (kept if the same); with
        ``text`` and ``audio``, the user's turn, its first clause is spoken ahead."""
        if self.current is not None and self.current.matches(messages, sampling):
            return
        await self.drop(CANCELLED)
        s = self.shared
        speak, codes = None, None
        if audio is not None and len(audio) and s.agent.speaks and not takes_words(s.backends, s.agent.tts_voice()):  # (DSM: one utterance)
            codes = s.context.encode_ahead(audio)
            speak = lambda clause: self._first_clause(clause, text, codes)  # noqa: E731
        self.current = Speculation(s.backends.llm_stream(messages, sampling=sampling), messages, sampling,
                                   s.cfg.engine_timeout_s, speak, s.cfg.clause_max_words, codes)

    def _first_clause(self, clause: str, text: str, codes: asyncio.Task) -> FirstClause | None:
        s = self.shared
        voice = s.agent.tts_voice()
        if takes_words(s.backends, voice):
            return None  # the voice changed to one that takes words (DSM): its reply is one utterance

        async def start():
            context = s.context.with_user(text, await asyncio.shield(codes))
            return s.backends.tts_stream(clause, context) if voice is None else \
                s.backends.tts_stream(clause, context, voice)

        return FirstClause(clause, voice, start, s.cfg.engine_timeout_s)

    def user_codes(self, text: str) -> asyncio.Task | None:
        """The running speculation's encode of the user's audio, if it was started on ``text``:
        the TTS context takes it, not a second encode."""
        spec = self.current
        if spec is None or spec.messages[-1] != {"role": "user", "content": text}:
            return None
        return spec.take_codes()

    async def take(self, messages: list[dict], sampling) -> Speculation | None:
        """The speculation started on exactly this prompt, else None (and it is cancelled)."""
        spec = self.current
        if spec is None:
            return None
        if spec.matches(messages, sampling):
            self.current = None
            self._count(HIT)
            return spec
        await self.drop(MISS)
        return None

    async def drop(self, outcome: str) -> None:
        spec, self.current = self.current, None
        if spec is not None:
            await spec.drop()
            self._count(outcome)

    def _count(self, outcome: str) -> None:
        self.outcomes[outcome] = self.outcomes.get(outcome, 0) + 1
        self.shared.observer.speculation(outcome)
