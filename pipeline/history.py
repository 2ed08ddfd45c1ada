"""A conversation's items: what was said, by whom, in order, each with an id a client can name.

The LLM reads the history as chat messages (:meth:`History.messages`). A client may add items
where it likes, delete them, and truncate an assistant item to the audio it actually played
(the Realtime protocol's ``conversation.item.*``); an assistant item remembers where each of its
clauses began in its audio, and the TTS context segment made from its codes, for that.
At most ``max_items`` are kept: the oldest go first (the LLM sees only its token budget anyway).
"""
from __future__ import annotations

import uuid
from dataclasses import dataclass, field

import numpy as np

from pipeline.tts.prompt import Segment

ROLES = ("user", "assistant")
SAMPLE_RATE = 24_000  # reply audio
FRAME_SIZE = 1920  # samples of one Mimi frame (80 ms): the unit of the TTS context codes


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
        return 1000 * self.audio_samples / SAMPLE_RATE

    @classmethod
    def call(cls, call_id: str, name: str, arguments: str) -> "Item":
        return cls("assistant", "", kind="function_call", call_id=call_id, name=name, arguments=arguments)

    @classmethod
    def output(cls, call_id: str, output: str) -> "Item":
        return cls("tool", output, kind="function_call_output", call_id=call_id)


class UnknownItem(KeyError):
    """No item of that id (never added, deleted, or dropped as the oldest)."""


class History:
    def __init__(self, max_items: int = 1000):
        self.items: list[Item] = []
        self.max_items = max_items

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
        del self.items[: -self.max_items]
        return item

    def previous_id(self, item: Item) -> str | None:
        i = self.items.index(item)
        return self.items[i - 1].id if i else None

    def delete(self, item_id: str) -> Item:
        item = self.get(item_id)
        self.items.remove(item)
        return item

    @staticmethod
    def truncate(item: Item, audio_end_ms: float) -> None:
        """Keep only what ``item``'s first ``audio_end_ms`` of audio said: the clauses whose audio
        had begun by then, and the context codes of the frames played."""
        if item.role != "assistant" or not item.audio:
            raise ValueError(f"item {item.id} has no audio to truncate")
        if not 0 <= audio_end_ms <= item.audio_ms:
            raise ValueError(f"audio_end_ms {audio_end_ms:g} is beyond the item's {item.audio_ms:.0f} ms of audio")
        cut = int(audio_end_ms * SAMPLE_RATE / 1000)
        item.clauses = [(start, clause) for start, clause in item.clauses if start < cut]
        item.text = " ".join(clause for _, clause in item.clauses)
        item.audio_samples = cut
        if item.segment is not None:
            frames = -(-cut // FRAME_SIZE)
            item.segment.codes = np.asarray(item.segment.codes)[:frames]
            item.segment.text = item.text
