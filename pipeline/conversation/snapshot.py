"""What a conversation is, taken whole: a :class:`Snapshot` (``Conversation.snapshot`` and
``restore``), and the reply that was in flight when its connection ended (:class:`InFlight`).
Resuming (``pipeline/resume/``) keeps snapshots and hands them back; the conversation needs
nothing of it."""
from __future__ import annotations

import pickle
from dataclasses import dataclass, field

from pipeline.conversation.agent import AgentSettings
from pipeline.conversation.history import Item
from pipeline.engines import Segment


@dataclass
class InFlight:
    """The reply that was being sent when the connection ended: its turn, its history item, and
    the audio it had sent as ``(seq, samples of the item's audio up to the end of that message)``."""

    turn: int
    item_id: str
    sent: list[tuple[int, int]] = field(default_factory=list)

    def samples_received(self, turn: int | None, seq: int | None) -> int:
        """The item's audio the client has, given the last ``audio`` message it received."""
        if turn != self.turn or seq is None:
            return 0
        return max((end for s, end in self.sent if s <= seq), default=0)


@dataclass
class Snapshot:
    """What a resumed conversation starts from (``Conversation.snapshot`` / ``restore``)."""

    session_id: str
    turn: int  # the last user turn that ended
    items: list[Item]
    agent: AgentSettings
    context: list[Segment]
    in_flight: InFlight | None = None
    saved_at: float = 0.0  # Unix seconds

    def dumps(self) -> bytes:
        """A copy that later changes to the live conversation do not reach (and its size)."""
        return pickle.dumps(self, protocol=pickle.HIGHEST_PROTOCOL)

    @staticmethod
    def loads(blob: bytes) -> "Snapshot":
        return pickle.loads(blob)  # noqa: S301 - only ever what a gateway of this app put in the store
