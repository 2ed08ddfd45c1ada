"""What the recogniser hears of one conversation: the spoken turn being heard, with its STT slot
and stream.

A conversation holds an STT slot only during a spoken turn: from the turn's first audio frame to
its end. Idle or typing sessions hold none, so open sockets never lock speakers out; a turn that
finds every slot busy is told so once (``no_free_slot``), its audio is dropped, and a later frame
of it tries again after ``slot_retry_s``. A replica that does not know the turn's stream (its
routing key moved) gets the turn's audio replayed on a stream opened again; one that fails or
does not answer within ``engine_timeout_s`` loses the turn's audio so far, told once.
"""
from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Awaitable, Callable

import numpy as np

from pipeline.audio import pieces
from pipeline.engines import Backends, EngineUnavailable, NoFreeSlot, UnknownStream, bounded
from pipeline.errors import E_ENGINE_UNAVAILABLE, E_INVALID_VALUE, E_NO_FREE_SLOT
from pipeline.conversation.history import new_id
from pipeline.session_config import SessionConfig

log = logging.getLogger(__name__)


@dataclass
class UserTurn:
    """The spoken turn being heard: all of its state, replaced whole when it ends."""

    item_id: str = field(default_factory=lambda: new_id("item"))  # its history item (speech events name it)
    open: bool = False  # audio of it has arrived and it has not ended
    partial: str = ""
    audio: list[np.ndarray] = field(default_factory=list)  # the recognised audio, at most max_turn_s
    samples: int = 0  # samples in ``audio``
    loud: bool = False  # some of its audio is loud enough to barge in by words
    holds_slot: bool = False  # an STT slot may be held for it (close() releases it)
    slot_taken_at: float = 0.0  # when it got its slot (the max_turn_s clock)
    refused_at: float | None = None  # last refusal of its slot; None: not refused
    eot_deadline: float | None = None  # a pause Smart Turn called incomplete ends the turn then
    eot_check_at_ms: float | None = None  # in a pause: the silence at which Smart Turn judges it again
    lull: bool = False  # the silence since its last speech has reached preemptive_silence_ms

    def lose_audio(self, now: float) -> bool:
        """Its recogniser stream is gone (refused, or lost with its replica): the audio so far is
        dropped and a later frame tries again. True the first time (the client is told once)."""
        first = self.refused_at is None
        self.holds_slot, self.partial, self.audio, self.samples, self.refused_at = False, "", [], 0, now
        return first

    def joined_audio(self) -> np.ndarray:
        return np.concatenate(self.audio) if self.audio else np.zeros(0, np.int16)


class Recogniser:
    """One conversation's side of the STT engine: the stream ``stream_id`` for each spoken turn.
    ``cfg_now()`` is the conversation's SessionConfig now; ``error(code, message)`` tells the client;
    ``language_now()`` is the session's language now (None: the recogniser's default), heard from
    the next spoken turn on."""

    def __init__(self, backends: Backends, stream_id: str, cfg_now: Callable[[], SessionConfig],
                 clock: Callable[[], float], error: Callable[[str, str], Awaitable[None]],
                 language_now: Callable[[], str | None] = lambda: None):
        self.backends, self.stream_id, self.cfg_now, self.clock, self.error = backends, stream_id, cfg_now, clock, error
        self.language_now = language_now
        self.turn = UserTurn()
        # A slot given up after a failed call (a push or open past engine_timeout_s), being closed
        # on the replica without holding up the session; the next open waits for it (same stream id).
        self._closing: asyncio.Task | None = None

    def drop(self) -> None:
        """The turn is over (ended, refused or lost): the next audio starts a new one."""
        self.turn = UserTurn()

    async def begin(self) -> None:
        """A new spoken turn (keeping the item id speech events already named) takes a slot."""
        self.turn = UserTurn(item_id=self.turn.item_id, open=True)
        await self._take_slot()

    async def retry(self) -> None:
        """A refused turn asks again at most every ``slot_retry_s``, so hands-free clients recover."""
        if self.clock() - self.turn.refused_at >= self.cfg_now().slot_retry_s:
            await self._take_slot()

    async def _engine(self, call):
        return await bounded(call, self.cfg_now().engine_timeout_s)

    async def push(self, pcm: np.ndarray) -> list[dict]:
        """The turn's next audio: the recogniser's events (partials, endpoint); none if the turn
        lost its stream here (the client has been told)."""
        turn = self.turn
        turn.audio.append(pcm)
        turn.samples += len(pcm)
        if not turn.loud:
            rms = float(np.sqrt(np.mean(np.square(pcm.astype(np.float32) / 32768.0))))
            turn.loud = rms >= self.cfg_now().barge_in_min_rms
        try:
            try:
                return await self._engine(self.backends.stt_push(self.stream_id, pcm))
            except UnknownStream:
                return await self._restart_stream()
        except EngineUnavailable as exc:
            self._close_in_background()
            await self._lose_slot(E_ENGINE_UNAVAILABLE, f"the recogniser failed mid-turn ({exc}); this turn's "
                                  "audio so far is lost (the session stays open; speak again)")
            return []

    async def _take_slot(self) -> None:
        """Take an STT slot for the open turn. Refused, the client hears it once per turn, the
        turn's audio is dropped, and a later frame of it tries again (:meth:`retry`)."""
        await self.wait_closed()
        self.turn.holds_slot = True  # set first: if this call is cancelled midway, close() still releases
        try:
            await self._engine(self.backends.stt_open(self.stream_id, self.language_now()))
        except NoFreeSlot as exc:
            await self._lose_slot(E_NO_FREE_SLOT, f"{exc}; this turn's audio is dropped until a slot frees "
                                  "(the session stays open: speak on, speak again later, or type)")
            return
        except ValueError as exc:  # a language the recogniser does not speak (the session's is checked first)
            await self._lose_slot(E_INVALID_VALUE, f"the recogniser refused this turn: {exc}; its audio is dropped")
            return
        except EngineUnavailable as exc:  # the open may still take the slot after we gave up on it
            self._close_in_background()
            await self._lose_slot(E_ENGINE_UNAVAILABLE, f"the recogniser is unavailable ({exc}); this turn's "
                                  "audio is dropped until it answers (the session stays open)")
            return
        self.turn.refused_at = None
        self.turn.slot_taken_at = self.clock()

    async def _lose_slot(self, code: str, message: str) -> None:
        if self.turn.lose_audio(self.clock()):
            await self.error(code, message)

    async def peek(self) -> tuple[str, list[dict]] | None:
        """What :meth:`finish` would give now, the turn's stream going on (the recogniser ends a copy
        of it); None if that cannot be had (no spare slot, a failed or slow call)."""
        if not self.turn.holds_slot:
            return None
        try:
            return await self._engine(self.backends.stt_peek(self.stream_id))
        except (EngineUnavailable, UnknownStream):
            return None

    def let_go(self) -> None:
        """The turn's transcript is known (from :meth:`peek`): its stream is closed without holding
        up the session."""
        if self.turn.holds_slot:
            self._close_in_background()

    def _close_in_background(self) -> None:
        """A call on the turn's stream failed (timed out, or its replica is gone): close the stream
        on the replica at once, so its slot is free for others now, not at the replica's sweep."""
        self.turn.holds_slot = False
        if self._closing is None or self._closing.done():
            self._closing = asyncio.create_task(self._close_stream(self.stream_id))

    async def wait_closed(self) -> None:
        """Wait for a background close of this stream id to have been answered (or given up)."""
        if self._closing is not None:
            await asyncio.shield(self._closing)
            self._closing = None

    async def release(self) -> None:
        """Give the open turn's slot back without a transcript (cleared, or the session closed)."""
        await self.wait_closed()
        if not self.turn.holds_slot:
            return
        self.turn.holds_slot = False
        try:
            await self._engine(self.backends.stt_close(self.stream_id))
        except EngineUnavailable as exc:  # a replica that went away took the slot with it
            log.warning("stream %s: releasing the STT slot: %s", self.stream_id, exc)
        except Exception:  # noqa: BLE001 - releasing must not raise
            log.exception("stream %s: releasing the STT slot failed", self.stream_id)

    async def _restart_stream(self) -> list[dict]:
        """The STT replica lost the turn's stream: open it again (wherever its key routes now) and
        replay the turn's audio so far; returns the replay's events. The partial transcript is
        rebuilt from them. Any failure here loses the turn (EngineUnavailable)."""
        log.warning("stream %s: the recogniser does not know this turn's stream; restarting it", self.stream_id)
        self.turn.partial = ""
        try:
            await self._engine(self.backends.stt_open(self.stream_id, self.language_now()))
            return await self._engine(self.backends.stt_push(self.stream_id, self.turn.joined_audio()))
        except (NoFreeSlot, UnknownStream) as exc:
            raise EngineUnavailable(f"restarting the turn's stream failed: {exc}") from None

    async def finish(self) -> tuple[str, list[dict]]:
        """The turn's transcript and word times; the slot is given back. Raises EngineUnavailable."""
        try:
            try:
                result = await self._engine(self.backends.stt_finish(self.stream_id))
            except UnknownStream:
                await self._restart_stream()
                result = await self._engine(self.backends.stt_finish(self.stream_id))
        except (EngineUnavailable, UnknownStream) as exc:
            self._close_in_background()  # a stalled replica may still hold the slot
            raise EngineUnavailable(str(exc)) from None
        self.turn.holds_slot = False
        return result

    async def transcribe(self, pcm: np.ndarray, stream_id: str) -> str:
        """Audio recognised whole on a stream of its own (a spoken turn may be open beside it).
        Raises EngineUnavailable (no free slot included)."""
        try:
            await self._engine(self.backends.stt_open(stream_id, self.language_now()))
        except NoFreeSlot as exc:
            raise EngineUnavailable(f"no recogniser slot is free ({exc})") from None
        try:
            for piece in pieces(pcm):
                await self._engine(self.backends.stt_push(stream_id, piece))
            text, _ = await self._engine(self.backends.stt_finish(stream_id))
        except BaseException:
            await asyncio.shield(self._close_stream(stream_id))
            raise
        return text

    async def _close_stream(self, sid: str) -> None:
        try:
            await self._engine(self.backends.stt_close(sid))
        except Exception:  # noqa: BLE001 - the replica may be gone with it
            log.warning("closing STT stream %s failed", sid)
