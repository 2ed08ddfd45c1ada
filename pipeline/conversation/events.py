"""What a conversation tells its client, as typed events through one ``emit``.

A protocol adapter maps each event to its wire's messages (or to none: not every wire has a
message for everything). Events carry what a wire needs to say them, so an adapter reads nothing
else of the core: item ids, the item before, the transcript a cut reply keeps.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Awaitable, Callable

import numpy as np

from pipeline.engines import ToolCall
from pipeline.conversation.history import Item
from pipeline.conversation.reply import Reply


@dataclass(frozen=True)
class SpeechStarted:
    audio_ms: float  # where in the session's microphone audio
    item_id: str  # the user item the speech will become


@dataclass(frozen=True)
class SpeechStopped:
    audio_ms: float
    item_id: str


@dataclass(frozen=True)
class TranscriptDelta:
    turn: int  # the number the open turn will have
    item_id: str
    delta: str
    text: str  # the turn's partial transcript so far


@dataclass(frozen=True)
class TurnEnded:
    """A user turn ended: ``item`` is in the history unless its text is empty."""

    turn: int
    item: Item
    text: str  # as recognised or typed
    words: list[dict] | None  # word times of a spoken turn
    previous_id: str | None  # the item before it
    audio_s: float  # user audio heard since the last turn ended (committed audio)


@dataclass(frozen=True)
class ReplyStarted:
    reply: Reply
    previous_id: str | None  # the item its assistant item follows


@dataclass(frozen=True)
class ReplyText:
    reply: Reply
    delta: str


@dataclass(frozen=True)
class ReplyAudio:
    reply: Reply
    pcm: np.ndarray  # int16 24 kHz
    seq: int  # numbers the audio of the turn's response: it runs on across the replies of one turn


@dataclass(frozen=True)
class ReplyPaused:
    """Speech over the reply that may be no turn: nothing more is sent until it resumes or ends."""

    reply: Reply


@dataclass(frozen=True)
class ReplyResumed:
    reply: Reply


@dataclass(frozen=True)
class ReplyDone:
    """One reply ended: ``reply.status`` and ``reply.reason`` say how. ``transcript``: what the
    history keeps of it (a cut reply: what was said; else all it wrote); ``calls``: the history
    items of the tool calls it made."""

    reply: Reply
    transcript: str
    calls: list[Item] = field(default_factory=list)


@dataclass(frozen=True)
class TurnDone:
    """The response to user turn ``turn`` is over: no reply will answer it any more (a turn whose
    reply called tools is answered by several replies: the last one ends it)."""

    turn: int
    interrupted: bool
    timings: dict | None  # the last reply's marks (ms), when it completed


@dataclass(frozen=True)
class ToolCallAsked:
    """The LLM called a tool: the client runs it and sends its result."""

    reply: Reply
    call: ToolCall
    item: Item  # the call's history item
    previous_id: str | None


@dataclass(frozen=True)
class ToolCancelled:
    """A call whose result is no longer wanted: ``reason`` "cancelled" (the user spoke) or "timeout"."""

    call: ToolCall
    turn: int
    reason: str


@dataclass(frozen=True)
class PlaybackCut:
    """Speech over a reply that was sent whole and still plays, where the server holds the client's
    playback (``holds_playback``): the client drops the rest of it; its item was truncated to
    ``audio_end_ms`` (None: nothing was reported played of it, the item is as it was)."""

    reply_id: str
    item_id: str
    audio_end_ms: int | None


@dataclass(frozen=True)
class CallOver:
    """A call the agent ended (``EndCall``) is over: its last words have played, or its time is up.
    ``transfer_to``: where it goes (None: hung up)."""

    transfer_to: str | None


@dataclass(frozen=True)
class Error:
    code: str  # pipeline/errors.py
    message: str


Event = (SpeechStarted | SpeechStopped | TranscriptDelta | TurnEnded | ReplyStarted | ReplyText | ReplyAudio
         | ReplyPaused | ReplyResumed | ReplyDone | TurnDone | ToolCallAsked | ToolCancelled | PlaybackCut | CallOver
         | Error)
Emit = Callable[[Event], Awaitable[None]]
