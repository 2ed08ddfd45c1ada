"""What every protocol adapter offers the connection (``pipeline/connection.py``), whatever its
wire: the frames in (``on_frame``), the greeting, errors, deadlines, leaving and closing. An
adapter builds its :class:`~pipeline.conversation.core.Conversation` as ``self.core`` with its
own ``emit`` and sends through :meth:`send_frame`, one frame at a time."""
from __future__ import annotations

import asyncio
from typing import Awaitable, Callable

from pipeline.conversation.core import Conversation
from pipeline.conversation.snapshot import InFlight
from pipeline.session_config import SessionConfig


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

    def __init__(self, send: Callable[[bytes | str], Awaitable[None]]):
        self._send_raw = send
        self._send_lock = asyncio.Lock()

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

    def in_flight(self) -> InFlight | None:
        """The reply being sent, as the wire counted its audio messages (resumable wires)."""
        return self.core.replies.in_flight if self.resumable else None

    async def going_away(self, resume_token: str | None, reason: str) -> None:
        """The server stops serving this connection (a draining replica): stop the reply being sent."""
        await self.core.stop_replying()

    @property
    def cfg(self) -> SessionConfig:
        return self.core.cfg

    @property
    def closed(self) -> bool:
        return self.core.closed

    @property
    def deadline_changed(self) -> asyncio.Event:
        return self.core.deadline_changed

    def next_deadline(self) -> float:
        return self.core.next_deadline()

    async def check_deadlines(self) -> bool:
        return await self.core.check_deadlines()

    async def send_error(self, code: str, message: str) -> None:
        await self.core.shared.error(code, message)

    async def close(self) -> None:
        await self.core.close()
