"""What a client asks of its conversation, as typed commands (``Conversation.do``).

An adapter turns each wire message into one of these; the core checks it (bad settings raise
``BadSetting``, the conversation's limits ``Refusal``) and acts, changing nothing when it refuses.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pipeline.conversation.history import Item


@dataclass(frozen=True)
class Hear:
    """One microphone frame: int16 at USER_RATE."""

    pcm: np.ndarray


@dataclass(frozen=True)
class EndTurn:
    """The client ends the spoken turn (push-to-talk, commit); ``respond``: a reply follows."""

    respond: bool = True
    overrides: dict[str, Any] = field(default_factory=dict)  # agent settings of that reply only


@dataclass(frozen=True)
class UserText:
    """A typed user turn; spoken audio in flight becomes its own turn first."""

    text: str
    respond: bool = True
    overrides: dict[str, Any] = field(default_factory=dict)
    after: str | None = None  # the history item it follows (None: the end)


@dataclass(frozen=True)
class AddItem:
    """An item added to the history as it is: no turn, no reply."""

    item: Item
    after: str | None = None


@dataclass(frozen=True)
class AddUserAudio:
    """A user message given as audio (int16 USER_RATE), recognised whole: no turn, no reply."""

    pcm: np.ndarray
    after: str | None = None


@dataclass(frozen=True)
class Respond:
    """Start a reply to the conversation so far (only one runs at a time)."""

    overrides: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class CancelReply:
    """Cancel the running reply (``response_id``: only if it is that one)."""

    response_id: str | None = None


@dataclass(frozen=True)
class Played:
    """The client played the reply's item ``item_id`` up to ``audio_ms`` (a phone's mark came back):
    cut there, the history keeps what was heard, not only what was sent."""

    item_id: str
    audio_ms: float


@dataclass(frozen=True)
class Digits:
    """Keys the caller pressed (DTMF): a user turn that says which."""

    digits: str


@dataclass(frozen=True)
class ClearAudio:
    """Drop the open spoken turn's audio."""


@dataclass(frozen=True)
class Truncate:
    """Keep only what the client played of an assistant item."""

    item_id: str
    audio_end_ms: int


@dataclass(frozen=True)
class DeleteItem:
    item_id: str


@dataclass(frozen=True)
class ToolResult:
    """The client's result of a tool call. Once the last pending call has one, ``then`` says what
    follows: "respond" (a reply that uses the results), "close" (nothing more is said) or None
    (the client asks for a reply itself)."""

    call_id: str
    output: str
    then: str | None = None


@dataclass(frozen=True)
class VoiceClip:
    """A session's own reference clip: int16 at REPLY_RATE and what it says."""

    pcm: np.ndarray
    text: str


@dataclass(frozen=True)
class Configure:
    """Change the session's settings, all checked before any applies: ``turn_taking``
    (SessionConfig fields), ``agent`` (AgentSettings fields), ``reply_on_turn_end`` (a turn the
    server ends gets a reply) and a ``voice_clip`` to encode for the voice."""

    turn_taking: dict[str, Any] = field(default_factory=dict)
    agent: dict[str, Any] = field(default_factory=dict)
    reply_on_turn_end: bool | None = None
    voice_clip: VoiceClip | None = None


Command = (Hear | EndTurn | UserText | AddItem | AddUserAudio | Respond | CancelReply | Played | Digits | ClearAudio
           | Truncate | DeleteItem | ToolResult | Configure)
