"""One client connection from admission to clean-up, independent of the web framework and of the
wire protocol.

The gateway adapts its WebSocket to :class:`Connection` and hands it to :func:`serve_connection`
with the adapter of the endpoint's protocol (a ``pipeline.wire.WireSession``: v1's
``pipeline.adapters.v1.adapter.Session``, the Realtime protocol's ``pipeline.adapters.realtime.adapter.RealtimeSession``); tests drive the same code with
an in-memory connection, so the session limits (``max_sessions``, ``idle_timeout_s``, the
wall-clock side of ``max_turn_s``) are tested without Ray.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from dataclasses import dataclass
from typing import Any, Callable, Protocol

from pipeline import errors
from pipeline.wire import CloseConnection, WireSession
from pipeline.conversation.observer import Observer
from pipeline.engines import Backends, ClientGone
from pipeline.records.keeper import RecordKeeper
from pipeline.records.store import Records
from pipeline.resume.keeper import Continuity, Keeper
from pipeline.resume.tokens import RESUME_PARAM, ResumeRefused, received
from pipeline.session_config import SessionConfig

log = logging.getLogger(__name__)


class Connection(Protocol):
    async def receive(self) -> bytes | str | None: ...  # the next client frame; None once the client left
    async def send(self, frame: bytes | str) -> None: ...  # binary or text; raises ClientGone if the client left
    async def close(self, code: int, reason: str) -> None: ...


class SessionRegistry:
    """The sessions one gateway replica holds, at most ``max_sessions``. The count is checked and
    taken without an await in between, so concurrent connections never overshoot it."""

    def __init__(self, max_sessions: int, on_count: Callable[[int], None] | None = None):
        self.max_sessions = max_sessions
        self._sessions: set[WireSession] = set()  # by identity: a resumed session shares its id with the one it replaces
        self._on_count = on_count
        self._emptied = asyncio.Event()
        self.draining = False  # set by drain(): every session is asked to leave, new ones are refused

    def __len__(self) -> int:
        return len(self._sessions)

    def __iter__(self):
        return iter(list(self._sessions))

    @property
    def full(self) -> bool:
        return len(self._sessions) >= self.max_sessions

    def add(self, session: WireSession) -> None:
        """Hold ``session``; a session of the same id still here (a resume of a live connection) is
        told to leave: the newer connection wins. Both count until the older one has gone."""
        if self.full:
            raise RuntimeError(f"session registry is full ({self.max_sessions})")
        for older in [s for s in self._sessions if s.id == session.id]:
            older.replaced()
        self._sessions.add(session)
        self._changed()

    def remove(self, session: WireSession) -> None:
        if session in self._sessions:
            self._sessions.remove(session)
            self._changed()

    def _changed(self) -> None:
        if self._on_count:
            self._on_count(len(self._sessions))
        if not self._sessions:
            self._emptied.set()

    async def drain(self, timeout_s: float) -> int:
        """This replica stops: each session is asked to leave (its client is told to resume
        elsewhere, ``going_away``, and closed with 1012); wait up to ``timeout_s`` for them to go.
        Returns how many were still here at the end."""
        self.draining = True
        for session in list(self._sessions):
            session.leaving.set()
        if self._sessions:
            self._emptied.clear()
            try:
                await asyncio.wait_for(self._emptied.wait(), timeout_s)
            except asyncio.TimeoutError:
                pass
        return len(self._sessions)


@dataclass
class Resumption:
    """A connection's side of resuming (pipeline/resume/tokens.py): the replica's store, who connected
    (``Authenticator.principal``), and the handshake's query (``?resume=`` and what the client
    received, for a reconnection)."""

    continuity: Continuity
    principal: str
    query: dict[str, str] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class Recording:
    """Where a session's call record is kept (pipeline/records/), whose it is, and its transport."""

    records: Records
    principal: str
    transport: str

    def keeper(self, record, resumed: bool = False) -> RecordKeeper:
        return RecordKeeper(self.records, record, self.principal, self.transport, resumed)


async def serve_connection(conn: Connection, backends: Backends, cfg: SessionConfig,
                           registry: SessionRegistry, session_class: type[WireSession],
                           resumption: Resumption | None = None, observer: Observer | None = None,
                           recording: Recording | None = None, **session_args: Any) -> None:
    """Run one client's session (of ``session_class``, built with ``session_args`` besides its
    send, backends, settings and metrics ``observer``): refuse it if the replica is full, else greet it, feed it frames
    until the client leaves or a limit closes it, and release everything it held. With
    ``resumption`` (and a resumable wire), the session is kept resumable, or resumes the one its
    ``?resume=`` token names; with ``recording``, its call record is kept in that store."""
    # Over 40 lines as one function: a connection's life in order, start to end, under one try.
    observer = observer or Observer()
    if registry.full or registry.draining:
        await _refuse_busy(conn, observer, registry.max_sessions, session_class)
        return
    resumption = resumption if resumption is not None and session_class.resumable else None
    restored = await _take_snapshot(conn, resumption, session_class) if resumption is not None else None
    if restored is False:
        return
    if registry.full or registry.draining:
        await _refuse_busy(conn, observer, registry.max_sessions, session_class)
        return
    snap, generation = restored or (None, 0)
    session = session_class(conn.send, backends, cfg, session_id=snap.session_id if snap else None,
                            observer=observer, **session_args)
    session.leaving = asyncio.Event()
    if snap is not None:
        session.restore(snap, generation, received(resumption.query))
    keeper = Keeper(resumption.continuity, session, resumption.principal, generation) if resumption else None
    recorder = recording.keeper(session.core.record, resumed=snap is not None) if recording is not None else None
    registry.add(session)
    try:
        if keeper is not None:
            keeper.start()
        if recorder is not None:
            recorder.start()
        await session.start()
        if await _receive_loop(conn, session) == LEAVING:
            await _leave(conn, session, keeper)
    except ClientGone:
        pass
    except CloseConnection as close:  # the adapter ends it (a phone call's stop, a bad stream)
        await _close_quietly(conn, session, close.code, close.message, close.close_code, close.reason)
    except Exception as exc:  # noqa: BLE001 - one session's fault closes that session only
        log.exception("session %s failed", session.id)
        await _close_quietly(conn, session, errors.E_INTERNAL, f"session failed: {type(exc).__name__}",
                             errors.CLOSE_INTERNAL_ERROR, "internal error")
    finally:
        try:
            await session.close()
            if keeper is not None:
                await keeper.finish()
            if recorder is not None:
                await recorder.finish()
        finally:
            registry.remove(session)


async def _take_snapshot(conn: Connection, resumption: Resumption, session_class: type):
    """A reconnection's snapshot and generation; None for a new session; False once refused
    (the client was told: ``resume_refused`` and close 1008, or the store is unreachable:
    ``server_busy`` and 1013)."""
    token = resumption.query.get(RESUME_PARAM)
    if token is None:
        return None
    try:
        received(resumption.query)  # checked before the token is used up
        return await resumption.continuity.take(token, resumption.principal)
    except (ResumeRefused, ValueError) as exc:
        await _refuse(conn, session_class, errors.E_RESUME_REFUSED, str(exc), errors.CLOSE_POLICY_VIOLATION, "resume refused")
    except Exception as exc:  # noqa: BLE001 - the store timed out, or its replica is gone
        log.warning("resume: the session store: %s: %s", type(exc).__name__, exc)
        await _refuse(conn, session_class, errors.E_SERVER_BUSY, "sessions cannot be resumed right now; try again "
                      "shortly", errors.CLOSE_TRY_AGAIN_LATER, "server busy")
    return False


async def _leave(conn: Connection, session: WireSession, keeper: Keeper | None) -> None:
    """The replica drains: the reply stops at a chunk, the conversation is saved as the client
    has it, the client is told to resume elsewhere (``going_away``), and the socket closes 1012.
    Or a newer connection resumed the session: this one is told so and closed with 4001."""
    await session.core.stop_replying()
    if session.replaced_by_resume:
        await _close_quietly(conn, session, errors.E_SESSION_REPLACED, "a newer connection resumed this session; "
                             "this one is closed", errors.CLOSE_SESSION_REPLACED, "session resumed elsewhere")
        return
    if keeper is not None:
        await keeper.finish()
    await session.going_away(keeper.token if keeper else None, "server_shutdown")
    await conn.close(errors.CLOSE_SERVICE_RESTART, "server restarting; resume")


async def _refuse_busy(conn: Connection, observer: Observer, max_sessions: int, session_class: type) -> None:
    """Over the cap (or draining): one error and close 1013, before any session or engine state exists."""
    observer.error(errors.E_SERVER_BUSY)
    message = f"this server holds its maximum of {max_sessions} sessions; try again later"
    await _refuse(conn, session_class, errors.E_SERVER_BUSY, message, errors.CLOSE_TRY_AGAIN_LATER, "server busy")


async def _refuse(conn: Connection, session_class: type, code: str, message: str, close_code: int,
                  reason: str) -> None:
    try:
        await conn.send(session_class.error_frame(code, message))
        await conn.close(close_code, reason)
    except ClientGone:
        pass


LEAVING = "leaving"  # what the receive loop returns when the session was asked to leave (a drain)


async def _receive_loop(conn: Connection, session: WireSession) -> str | None:
    """Frames go to the session in order; between frames the session's deadlines (the open turn's
    time cap, a pause's end, a tool call's filler and timeout, the idle limit) are checked, so a
    silent client is still served by its limits. A deadline set between frames (a tool call the
    LLM just made) wakes the wait at once; a frame being received is never abandoned. Returns
    LEAVING once ``session.leaving`` is set (between frames), else None."""
    frame_task: asyncio.Task | None = None
    changed = session.deadline_changed
    leaving = asyncio.ensure_future(session.leaving.wait())
    try:
        while True:
            if frame_task is None:
                frame_task = asyncio.ensure_future(conn.receive())
            changed.clear()
            wake = asyncio.ensure_future(changed.wait())
            timeout = max(0.0, session.next_deadline() - time.monotonic())
            done, _ = await asyncio.wait({frame_task, wake, leaving}, timeout=timeout,
                                         return_when=asyncio.FIRST_COMPLETED)
            wake.cancel()
            if frame_task in done:
                frame, frame_task = frame_task.result(), None
                if frame is None:
                    return None
                await session.on_frame(frame)
            elif leaving in done:
                return LEAVING
            elif wake not in done and (idle_s := await session.check_deadlines()) is not None:
                await _close_quietly(conn, session, errors.E_IDLE_TIMEOUT, f"nothing sent either way for {idle_s:g} s; "
                                     "closing", errors.CLOSE_NORMAL, "idle timeout")
                return None
    finally:
        leaving.cancel()
        if frame_task is not None:
            frame_task.cancel()


async def _close_quietly(conn: Connection, session: WireSession, code: str, message: str,
                         close_code: int, reason: str) -> None:
    """The last word to a client that may already be gone (no ``code``: nothing to tell it)."""
    try:
        if code:
            await session.send_error(code, message)
        await conn.close(close_code, reason)
    except Exception:  # noqa: BLE001 - nothing more to tell a client we cannot reach
        pass
