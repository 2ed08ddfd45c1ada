"""A speculated reply's first clause, spoken ahead: its TTS stream started before the user's turn
is confirmed over, and its chunks kept until the reply takes them.

Preemptive generation (``pipeline/conversation/speculation.py``) starts the LLM in a pause; once
the LLM has written the reply's first clause, a :class:`FirstClause` starts the TTS on it with the
context the reply will have (the conversation's context and the user's turn, encoded from the
audio so far) and the session's voice. Nothing of it reaches the client: the reply whose first
clause and voice are these takes the chunks (:meth:`chunks`: those made so far, then the rest as
they come); otherwise it is cancelled and its stream closed. What it keeps is one clause's audio.
"""
from __future__ import annotations

import asyncio
import contextlib
from typing import AsyncIterator, Awaitable, Callable

from pipeline.engines import Voice, bounded_stream

_END = object()


class Kept:
    """What a stream started ahead has made so far, for the one that takes it: items, then the
    end or the error that ended it (bounded by what that stream makes)."""

    def __init__(self):
        self._queue: asyncio.Queue = asyncio.Queue()

    def put(self, item) -> None:
        self._queue.put_nowait(item)

    def end(self) -> None:
        self._queue.put_nowait(_END)

    async def items(self):
        """Those made so far, then the rest as they come; the error, raised, where one ended it."""
        while (item := await self._queue.get()) is not _END:
            if isinstance(item, BaseException):
                raise item
            yield item


class FirstClause:
    """``clause`` in ``voice``: ``start()`` gives its TTS stream (it may wait for its context)."""

    def __init__(self, clause: str, voice: Voice | None, start: Callable[[], Awaitable[AsyncIterator]],
                 timeout_s: float):
        self.clause, self.voice = clause, voice
        self._made = Kept()  # (pcm, codes) so far: one clause's frames
        self._task = asyncio.create_task(self._run(start, timeout_s), name="first-clause")

    async def _run(self, start: Callable[[], Awaitable[AsyncIterator]], timeout_s: float) -> None:
        try:
            tts = await start()
            async with contextlib.aclosing(bounded_stream(tts, timeout_s)) as made:
                async for chunk in made:
                    self._made.put(chunk)
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # noqa: BLE001 - raised in the reply that takes it, as its own TTS would
            self._made.put(exc)
        self._made.end()

    def fits(self, clause: str, voice: Voice | None) -> bool:
        """Whether this is the reply's first clause as the reply would speak it."""
        return clause == self.clause and voice == self.voice

    async def chunks(self):
        """The clause's (pcm, codes) made so far, then the rest as they come (a TTS stream, for the
        reply that takes it). Closing it early cancels the TTS."""
        try:
            async for chunk in self._made.items():
                yield chunk
        finally:
            await self.cancel()

    async def cancel(self) -> None:
        """Stop the TTS (its stream is closed before this returns)."""
        if not self._task.done():
            self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)
