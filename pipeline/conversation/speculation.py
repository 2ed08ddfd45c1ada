"""Preemptive generation: the LLM starts on a hands-free turn's transcript so far at the pause,
while Smart Turn decides whether the turn is over and the recogniser finishes it.

At ``speech.stopped`` the conversation builds the prompt the turn would get if the transcript so
far were final, and a :class:`Speculation` runs the LLM on it, keeping what it writes. Nothing of
it reaches the client: if the turn ends and its prompt (history, instructions, tools and the
final transcript) is exactly the speculated one, the reply takes the speculation's stream
(:meth:`stream`: what was kept, then the rest as it comes); if the user speaks on, the turn ends
with another transcript, or anything else changes, the speculation is cancelled and its LLM
stream closed, so it costs nothing more than the tokens made so far. The TTS never starts before
the turn is confirmed. What it holds is bounded by the LLM's own reply length.
"""
from __future__ import annotations

import asyncio
import contextlib
from typing import AsyncIterator, Callable

from pipeline.engines import bounded_stream

_END = object()

# Outcomes, for the metrics: the reply used it; the turn ended with another prompt; the user spoke
# on (or the turn was dropped) before it ended.
HIT, MISS, CANCELLED = "hit", "miss", "cancelled"


class Speculation:
    """One LLM stream started ahead of a turn's end, on ``messages`` with ``sampling``."""

    def __init__(self, llm: AsyncIterator, messages: list[dict], sampling, timeout_s: float):
        self.messages, self.sampling = messages, sampling
        self._kept: asyncio.Queue = asyncio.Queue()  # deltas so far (bounded by the LLM's reply length)
        self.deltas = 0  # how many the LLM made (the work a miss wasted)
        self._task = asyncio.create_task(self._run(llm, timeout_s), name="speculation")

    async def _run(self, llm: AsyncIterator, timeout_s: float) -> None:
        try:
            async with contextlib.aclosing(bounded_stream(llm, timeout_s)) as deltas:
                async for delta in deltas:
                    self.deltas += 1
                    self._kept.put_nowait(delta)
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # noqa: BLE001 - handed to the reply that takes it, as its own LLM would
            self._kept.put_nowait(exc)
        self._kept.put_nowait(_END)

    def matches(self, messages: list[dict], sampling) -> bool:
        return messages == self.messages and sampling == self.sampling

    async def stream(self):
        """What the LLM wrote so far, then the rest as it comes (an LLM stream, for the reply that
        takes it). Closing it early cancels the LLM."""
        try:
            while (item := await self._kept.get()) is not _END:
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            await self.cancel()

    async def cancel(self) -> None:
        """Stop the LLM (its stream is closed before this returns)."""
        if not self._task.done():
            self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)


class Speculator:
    """One conversation's preemptive LLM starts: at most one at a time, and their outcomes so far.
    ``llm_stream(messages, sampling)`` starts an LLM stream; ``observe(outcome)`` counts one."""

    def __init__(self, llm_stream, timeout_s: Callable[[], float], observe: Callable[[str], None]):
        self.llm_stream, self.timeout_s, self.observe = llm_stream, timeout_s, observe
        self.current: Speculation | None = None
        self.outcomes: dict[str, int] = {}  # hit, miss, cancelled so far (for tests and tools)

    async def start(self, messages: list[dict], sampling) -> None:
        """Start the LLM on this prompt, replacing one started on another (kept if the same)."""
        if self.current is not None and self.current.matches(messages, sampling):
            return
        await self.drop(CANCELLED)
        self.current = Speculation(self.llm_stream(messages, sampling=sampling), messages, sampling,
                                   self.timeout_s())

    async def take(self, messages: list[dict], sampling):
        """The LLM stream started on exactly this prompt, else None (and it is cancelled)."""
        spec = self.current
        if spec is None:
            return None
        if spec.matches(messages, sampling):
            self.current = None
            self._count(HIT)
            return spec.stream()
        await self.drop(MISS)
        return None

    async def drop(self, outcome: str) -> None:
        spec, self.current = self.current, None
        if spec is not None:
            await spec.cancel()
            self._count(outcome)

    def _count(self, outcome: str) -> None:
        self.outcomes[outcome] = self.outcomes.get(outcome, 0) + 1
        self.observe(outcome)
