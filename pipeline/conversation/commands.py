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
    """The client ends the spoken turn (push-to-talk, commit); ``respond``: a reply follows (None:
    where the server takes turns hands-free and answers them). ``must_be_open``: refused
    (``no_open_turn``) when no audio was heard since the last turn ended."""

    respond: bool | None = True
    overrides: dict[str, Any] = field(default_factory=dict)  # agent settings of that reply only
    must_be_open: bool = False


@dataclass(frozen=True)
class UserText:
    """A typed user turn; spoken audio in flight becomes its own turn first."""

    text: str
    respond: bool = True
    overrides: dict[str, Any] = field(default_factory=dict)
    after: str | None = None  # the history item it follows (None: the end)


@dataclass(frozen=True)
class AddItem:
    """An item added to the history as it is: no turn, no reply. Returns :class:`Added`."""

    item: Item
    after: str | None = None


@dataclass(frozen=True)
class Added:
    """What ``AddItem`` and ``AddUserAudio`` return: the item, and the one before it."""

    item: Item
    previous_id: str | None


@dataclass(frozen=True)
class AddUserAudio:
    """A user message given as audio (int16 USER_RATE), recognised whole: no turn, no reply.
    Returns :class:`Added`."""

    pcm: np.ndarray
    after: str | None = None


@dataclass(frozen=True)
class Respond:
    """Start a reply to the conversation so far (only one runs at a time). ``metadata``: the
    client's own, carried by the reply (``reply.metadata``) to the events that tell of it."""

    overrides: dict[str, Any] = field(default_factory=dict)
    metadata: Any = None


@dataclass(frozen=True)
class CancelReply:
    """Cancel the running reply (``response_id``: only if it is that one)."""

    response_id: str | None = None


@dataclass(frozen=True)
class Played:
    """The client played the reply's item ``item_id`` up to ``audio_ms`` (a phone's mark came back,
    a WebRTC track's frames went out): cut there, the history keeps what was heard, not only what
    was sent. ``playing``: the client still has audio it was sent to play (False: it played all)."""

    item_id: str
    audio_ms: float
    playing: bool = True


@dataclass(frozen=True)
class Digits:
    """Keys the caller pressed (DTMF): a user turn that says which (``as_turn``), or kept for a
    ``collect_digits`` call (:class:`CollectDigits`)."""

    digits: str
    as_turn: bool = True


@dataclass(frozen=True)
class CollectDigits:
    """A ``collect_digits`` tool call waits for keys: its result is the keys typed up to ``#``, or
    ``max_digits`` of them (keys typed before it count)."""

    call_id: str
    max_digits: int


@dataclass(frozen=True)
class EndCall:
    """The agent ends the call: once its last words have played (``Played(playing=False)`` and no
    reply running), or ``within_s`` from now at the latest, ``CallOver`` says so. ``transfer_to``:
    where the call goes (None: it is hung up)."""

    within_s: float
    transfer_to: str | None = None


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
class GetItem:
    """Returns (the item, whether it is still being made: the running reply's)."""

    item_id: str


@dataclass(frozen=True)
class ToolResult:
    """The client's result of a tool call. Once the last pending call has one, ``then`` says what
    follows: "respond" (a reply that uses the results), "close" (nothing more is said) or None
    (the client asks for a reply itself). Returns :class:`Added` (its output item)."""

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
    server ends gets a reply) and a ``voice_clip`` to encode for the voice. ``greet``: then a reply
    starts (an agent that speaks first). Returns the agent settings."""

    turn_taking: dict[str, Any] = field(default_factory=dict)
    agent: dict[str, Any] = field(default_factory=dict)
    reply_on_turn_end: bool | None = None
    voice_clip: VoiceClip | None = None
    greet: bool = False


Command = (Hear | EndTurn | UserText | AddItem | AddUserAudio | Respond | CancelReply | Played | Digits
           | CollectDigits | EndCall | ClearAudio | Truncate | DeleteItem | GetItem | ToolResult | Configure)
