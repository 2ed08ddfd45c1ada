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
from typing import AsyncIterator

from pipeline.engines import bounded_stream

_END = object()

# Outcomes, for the metrics: the reply used it; the turn ended with another prompt; the user spoke
# on (or the turn was dropped) before it ended.
HIT, MISS, CANCELLED = "hit", "miss", "cancelled"


class Speculation:
    """One LLM stream started ahead of a turn's end, on ``messages`` with ``options``."""

    def __init__(self, llm: AsyncIterator, messages: list[dict], options: dict, timeout_s: float):
        self.messages, self.options = messages, options
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

    def matches(self, messages: list[dict], options: dict) -> bool:
        return messages == self.messages and options == self.options

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
