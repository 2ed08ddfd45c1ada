"""A conversation's items: what was said, by whom, in order, each with an id a client can name.

The LLM reads the history as chat messages (:meth:`History.messages`). A client may add items
where it likes, delete them, and truncate an assistant item to the audio it actually played
(the Realtime protocol's ``conversation.item.*``); an assistant item remembers where each of its
clauses began in its audio, and the TTS context segment made from its codes, for that.
The history is bounded as it grows (the LLM sees only its token budget anyway, and the whole
history goes with every LLM call): once it holds more than ``max_chars`` characters (of every
kind of item: messages' text, calls' names and arguments, outputs), or more than ``max_items``
items, the oldest whole user turns go, each with the replies, function calls and outputs that
follow it; with one user turn left, its oldest items go, all but the user's message and the item
just added (items a client adds are at most ``MAX_ITEM_CHARS``, so this bounds what a session holds).
A call and its output leave together.
A running total keeps that O(1) amortised per item added. A dropped item is unknown from then on
(:class:`UnknownItem`), as if deleted.
"""
from __future__ import annotations

import uuid
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from pipeline.audio_constants import CODEC_FRAME_SAMPLES, REPLY_RATE
from pipeline.engines import Segment

ROLES = ("user", "assistant")
# One item a client adds: its text, name and arguments together (as long as a session's instructions).
MAX_ITEM_CHARS = 16_000


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:20]}"


@dataclass
class Item:
    role: str  # "user" | "assistant" (function calls: "assistant"; their outputs: "tool")
    text: str  # a message's text; a function call's output for function_call_output items
    id: str = field(default_factory=lambda: new_id("item"))
    kind: str = "message"  # "message" | "function_call" | "function_call_output"
    call_id: str | None = None  # function calls and their outputs
    name: str | None = None  # function calls
    arguments: str | None = None  # function calls: JSON text
    audio: bool = False  # user: spoken (transcribed); assistant: its reply had audio
    # assistant items with audio: where each clause of ``text`` began (24 kHz samples), the audio's
    # length, and the TTS context segment of its codes (trimmed with the item)
    clauses: list[tuple[int, str]] = field(default_factory=list)
    audio_samples: int = 0
    segment: Segment | None = None

    @property
    def audio_ms(self) -> float:
        return 1000 * self.audio_samples / REPLY_RATE

    @classmethod
    def call(cls, call_id: str, name: str, arguments: str) -> "Item":
        return cls("assistant", "", kind="function_call", call_id=call_id, name=name, arguments=arguments)

    @classmethod
    def output(cls, call_id: str, output: str) -> "Item":
        return cls("tool", output, kind="function_call_output", call_id=call_id)


class UnknownItem(KeyError):
    """No item of that id (never added, deleted, or dropped as the oldest)."""


def item_chars(item: Item) -> int:
    """An item's size as the history counts it: its text, and a call's name and arguments."""
    return len(item.text) + len(item.name or "") + len(item.arguments or "")


class History:
    def __init__(self, max_items: int = 1000, max_chars: int | None = None,
                 on_change: Callable[[], None] | None = None):
        self.items: list[Item] = []
        self.on_change = on_change  # called after every add, delete and truncate
        self.max_items = max_items
        self.max_chars = max_chars  # None: no bound on the characters
        self.chars = 0  # the items' sizes, as counted when each joined (item_chars)
        self._sizes: dict[int, int] = {}  # id(item) -> its size as counted
        self._users = 0  # user messages among the items
        self._calls: Counter[str] = Counter()  # call_id -> its calls and outputs among the items

    def messages(self) -> list[dict]:
        """The items as chat messages (OpenAI's format): a function call joins the assistant
        message before it (or starts one), its output is a ``tool`` message."""
        out: list[dict] = []
        for item in self.items:
            if item.kind == "function_call":
                call = {"id": item.call_id, "type": "function", "function": {"name": item.name, "arguments": item.arguments}}
                if not (out and out[-1]["role"] == "assistant"):
                    out.append({"role": "assistant", "content": ""})
                out[-1].setdefault("tool_calls", []).append(call)
            elif item.kind == "function_call_output":
                out.append({"role": "tool", "tool_call_id": item.call_id, "content": item.text})
            else:
                out.append({"role": item.role, "content": item.text})
        return out

    def call(self, call_id: str) -> Item | None:
        """The function call item of ``call_id``, if the conversation has one."""
        return next((i for i in self.items if i.kind == "function_call" and i.call_id == call_id), None)

    @property
    def last(self) -> Item | None:
        return self.items[-1] if self.items else None

    def get(self, item_id: str) -> Item:
        for item in self.items:
            if item.id == item_id:
                return item
        raise UnknownItem(item_id)

    def add(self, item: Item, after: str | None = None, before: str | None = None) -> Item:
        """Append ``item``, or insert it after the item ``after`` ("root": first), or before ``before``."""
        if before is not None:
            self.items.insert(self.items.index(self.get(before)), item)
        elif after is None:
            self.items.append(item)
        elif after == "root":
            self.items.insert(0, item)
        else:
            self.items.insert(self.items.index(self.get(after)) + 1, item)
        self._count(item)
        self._bound(item)
        self._changed()
        return item

    def previous_id(self, item: Item) -> str | None:
        i = self.items.index(item)
        return self.items[i - 1].id if i else None

    def delete(self, item_id: str) -> Item:
        item = self.get(item_id)
        self.items.remove(item)
        self._uncount(item)
        self._changed()
        return item

    # -- the bound ------------------------------------------------------------------------------

    def _count(self, item: Item) -> None:
        size = self._sizes[id(item)] = item_chars(item)
        self.chars += size
        self._users += _is_user(item)
        if item.call_id is not None:
            self._calls[item.call_id] += 1

    def _uncount(self, item: Item) -> None:
        if id(item) not in self._sizes:
            return
        self.chars -= self._sizes.pop(id(item))
        self._users -= _is_user(item)
        if item.call_id is not None:
            self._calls[item.call_id] -= 1
            if not self._calls[item.call_id]:
                del self._calls[item.call_id]

    def _over(self) -> bool:
        return len(self.items) > self.max_items or (self.max_chars is not None and self.chars > self.max_chars)

    def _bound(self, newest: Item) -> None:
        """Drop the oldest whole user turns while over a limit; with one user turn left, its oldest
        items but the user's message and ``newest`` (replies, calls and outputs a client added after
        it), so the history stays within max_chars plus two items. Each item scanned here leaves, so
        the cost is O(1) amortised per item added."""
        while self._over():
            # The oldest turn ends where the next user message begins (one exists when a user
            # message other than the first item does): never the latest user turn.
            if self._users - _is_user(self.items[0]) > 0:
                cut = next(i for i in range(1, len(self.items)) if _is_user(self.items[i]))
                self._drop(self.items[:cut])
            else:
                oldest = next((item for item in self.items if not _is_user(item) and item is not newest), None)
                if oldest is None:
                    return  # the latest user message and the newest item alone are over max_chars: they stay
                self._drop([oldest])

    def _drop(self, gone: list[Item]) -> None:
        """Drop ``gone`` (the oldest items, or one of them), and any call or output elsewhere whose
        partner left with them (a call never stays without its output, nor an output without its call)."""
        if gone == self.items[:len(gone)]:
            del self.items[:len(gone)]
        else:
            self.items.remove(gone[0])
        for item in gone:
            self._uncount(item)
        orphans = {item.call_id for item in gone if item.call_id is not None and item.call_id in self._calls}
        if orphans:
            kept = []
            for item in self.items:
                if item.call_id in orphans:
                    self._uncount(item)
                else:
                    kept.append(item)
            self.items[:] = kept

    def truncate(self, item: Item, audio_end_ms: float) -> None:
        """Keep only what ``item``'s first ``audio_end_ms`` of audio said: the clauses whose audio
        had begun by then, and the context codes of the frames played."""
        if item.role != "assistant" or not item.audio:
            raise ValueError(f"item {item.id} has no audio to truncate")
        if not 0 <= audio_end_ms <= item.audio_ms:
            raise ValueError(f"audio_end_ms {audio_end_ms:g} is beyond the item's {item.audio_ms:.0f} ms of audio")
        cut = int(audio_end_ms * REPLY_RATE / 1000)
        item.clauses = [(start, clause) for start, clause in item.clauses if start < cut]
        item.text = " ".join(clause for _, clause in item.clauses)
        item.audio_samples = cut
        if item.segment is not None:
            frames = -(-cut // CODEC_FRAME_SAMPLES)  # the TTS context codes: one a Mimi frame
            item.segment.codes = np.asarray(item.segment.codes)[:frames]
            item.segment.text = item.text
        if id(item) in self._sizes:  # the running total follows the shorter text
            self.chars += item_chars(item) - self._sizes[id(item)]
            self._sizes[id(item)] = item_chars(item)
        self._changed()

    def _changed(self) -> None:
        if self.on_change is not None:
            self.on_change()


def _is_user(item: Item) -> bool:
    return item.role == "user" and item.kind == "message"
