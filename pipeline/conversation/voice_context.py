"""The TTS context of one conversation (CSM): the turns with audio so far, oldest first, at most
``context_turns``. User turns' audio is encoded once, in the background beside the LLM's first
tokens; bot turns bring the codes they were generated with."""
from __future__ import annotations

import asyncio
import logging
from typing import Callable

import numpy as np

from pipeline.engines import (BOT_SPEAKER, USER_SPEAKER, Backends, EngineUnavailable, Segment, Voice, bounded,
                              takes_words)
from pipeline.session_config import SessionConfig

log = logging.getLogger(__name__)


class VoiceContext:
    def __init__(self, backends: Backends, cfg_now: Callable[[], SessionConfig], changed: Callable[[], None],
                 name: str):
        self.backends, self.cfg_now, self.changed, self.name = backends, cfg_now, changed, name
        self.segments: list[Segment] = []
        self.encoding: asyncio.Task | None = None  # the last user turn's audio joining the context

    def add(self, seg: Segment) -> None:
        self.segments.append(seg)
        del self.segments[: -self.cfg_now().context_turns]
        self.changed()

    def remove(self, seg: Segment) -> None:
        if seg in self.segments:
            self.segments.remove(seg)

    def drop_bot(self) -> None:
        """A new voice: the bot's earlier turns were another voice."""
        self.segments = [seg for seg in self.segments if seg.speaker != BOT_SPEAKER]

    def take_encoding(self) -> asyncio.Task | None:
        """The encode a reply waits for before its first clause (the user's turn joins first)."""
        encoding, self.encoding = self.encoding, None
        return encoding

    def encode_later(self, text: str, pcm: np.ndarray, codes: asyncio.Task | None = None,
                     voice: Voice | None = None) -> None:
        """Encode a user turn's audio after the encodes before it: one at a time per conversation,
        and cancelling the last (as :meth:`cancel` does) cancels those it waits on. ``codes``: its
        encode already under way (:meth:`encode_ahead`), taken instead of a second one."""
        if takes_words(self.backends, voice):  # the session's voice takes words (DSM), and no context
            if codes is not None:
                codes.cancel()  # (made ahead for a voice the session has left)
            return
        before = self.encoding

        async def in_turn() -> None:
            if before is not None:  # gather: this task's cancellation cancels the one it waits on
                await asyncio.gather(before, return_exceptions=True)
            made = await codes if codes is not None else await self._codes_of(pcm)
            if len(made):
                self.add(Segment(USER_SPEAKER, text, made))

        self.encoding = asyncio.create_task(in_turn())

    def encode_ahead(self, pcm: np.ndarray) -> asyncio.Task:
        """Encode a user turn's audio before the turn is over (a reply started ahead needs it),
        after the encodes in flight, without joining the context: :meth:`encode_later` takes the
        task if the turn ends as it was; cancelling it leaves the encodes before it alone."""
        before = self.encoding

        async def ahead() -> np.ndarray:
            if before is not None:
                await asyncio.wait([before])
            return await self._codes_of(pcm)

        return asyncio.create_task(ahead())

    def with_user(self, text: str, codes: np.ndarray) -> list[Segment]:
        """The context as it will be once the user turn ``text`` (its ``codes``) has joined it."""
        segments = list(self.segments) + ([Segment(USER_SPEAKER, text, codes)] if len(codes) else [])
        return segments[-self.cfg_now().context_turns:]

    async def _codes_of(self, pcm: np.ndarray) -> np.ndarray:
        """A user turn's audio as Mimi codes; none where it could not be encoded."""
        try:
            return await bounded(self.backends.tts_encode(pcm), self.cfg_now().engine_timeout_s)
        except EngineUnavailable as exc:
            log.warning("session %s: encoding user audio: %s", self.name, exc)
        except Exception:  # noqa: BLE001 - context is an improvement, never a failure
            log.exception("session %s: encoding user audio failed", self.name)
        return np.zeros((0, 0), np.int64)

    def cancel(self) -> None:
        if self.encoding is not None:
            self.encoding.cancel()
