"""What every protocol adapter offers the connection (``pipeline/connection.py``), whatever its
wire: the frames in (``on_frame``), the greeting, errors, deadlines, leaving and closing. An
adapter builds its :class:`~pipeline.conversation.core.Conversation` with :meth:`conversation`
(its own ``emit``, this session's observer and wake-up) and sends through :meth:`send_frame`, one
frame at a time. It talks to the core through ``do`` and the events it gets back, nothing else."""
from __future__ import annotations

import asyncio
from typing import Awaitable, Callable

from pipeline.conversation.core import Conversation
from pipeline.conversation.events import Error
from pipeline.conversation.observer import Observer


class CloseConnection(Exception):
    """An adapter ends its connection: the client is told ``code`` and ``message`` (where its wire
    has a way to say them) and the socket closes with ``close_code`` and ``reason``."""

    def __init__(self, code: str | None, message: str, close_code: int, reason: str):
        super().__init__(message)
        self.code, self.message, self.close_code, self.reason = code, message, close_code, reason


class WireSession:
    core: Conversation
    resumable = False  # whether its wire lets a dropped connection resume (pipeline/resume/keeper.py)
    leaving: asyncio.Event  # set to make the connection end the session between frames
    replaced_by_resume = False
    resume_fields: dict | None = None  # what the greeting says of resuming (set by the keeper)

    def __init__(self, send: Callable[[bytes | str], Awaitable[None]], observer: Observer | None = None):
        self._send_raw = send
        self._send_lock = asyncio.Lock()
        self.observer = observer or Observer()  # what the session counts (the core counts into it too)
        self.deadline_changed = asyncio.Event()  # set when a deadline moved between frames (core's or ours)

    def conversation(self, backends, cfg, session_id, smart_turn, voices, clock, **options) -> Conversation:
        """This session's conversation core: it tells its events to ``self.emit``."""
        return Conversation(self.emit, backends, cfg, session_id, smart_turn, voices, clock, self.observer,
                            self.deadline_changed, **options)

    async def emit(self, event) -> None:
        raise NotImplementedError

    @property
    def id(self) -> str:
        return self.core.id

    async def send_frame(self, frame: bytes | str, is_error: bool = False) -> None:
        """One frame to the client; once the session is closed only errors still go."""
        if self.core.closed and not is_error:
            return
        async with self._send_lock:
            await self._send_raw(frame)
        self.core.touch()

    @staticmethod
    def error_frame(code: str, message: str) -> bytes | str:
        """An error message for a connection refused before any session exists."""
        raise NotImplementedError

    async def start(self) -> None:
        """Greet the client."""

    async def on_frame(self, frame: bytes | str) -> None:
        raise NotImplementedError

    def replaced(self) -> None:
        """A newer connection resumed this session: this one leaves (the newer one wins)."""
        self.replaced_by_resume = True
        self.leaving.set()

    def restore(self, snap, generation: int, received: tuple[int | None, int | None]) -> None:
        self.core.restore(snap, generation, received)

    async def going_away(self, resume_token: str | None, reason: str) -> None:
        """The server stops serving this connection (a draining replica): stop the reply being sent."""
        await self.core.stop_replying()

    @property
    def closed(self) -> bool:
        return self.core.closed

    def next_deadline(self) -> float:
        return self.core.next_deadline()

    async def check_deadlines(self) -> float | None:
        """Act on deadlines that passed; the idle limit (seconds) once it was reached, else None."""
        return await self.core.check_deadlines()

    async def send_error(self, code: str, message: str) -> None:
        self.observer.error(code)
        await self.emit(Error(code, message))

    async def close(self) -> None:
        await self.core.close()
