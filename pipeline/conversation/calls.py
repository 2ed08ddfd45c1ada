"""The tool calls a conversation waits on: asked by the LLM, answered by the client, or ended by
the user speaking over them or by their time limit.

:class:`ToolCalls` is bookkeeping only (no I/O): which calls are pending, when the oldest was
asked (the filler and timeout clocks), and how each ended, so a late or stray result gets a
clear answer. The conversation (``pipeline/conversation/tools.py``) acts on what it says.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from pipeline.engines import ToolCall
from pipeline.errors import E_TOOL_RESULT_TOO_LARGE

MAX_RESULT_BYTES = 16 * 1024  # a tool's output, UTF-8
ANSWERED, CANCELLED, TIMED_OUT = "answered", "cancelled", "timed out"


class ToolResultError(Exception):
    """A result the conversation cannot take; ``code`` is stable, ``message`` for humans."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code, self.message = code, message


@dataclass
class PendingCall:
    call: ToolCall
    turn: int
    reply_id: str  # the reply whose LLM made it
    asked_at: float  # monotonic
    overrides: dict = field(default_factory=dict)  # that reply's own settings: the answer's reply keeps them


class ToolCalls:
    def __init__(self, remember: int = 256):
        self.pending: dict[str, PendingCall] = {}
        self._ended: OrderedDict[str, str] = OrderedDict()  # call_id -> how it ended (the last ``remember``)
        self._remember = remember
        self.filler_spoken = False  # for the calls now pending

    def ask(self, call: ToolCall, turn: int, reply_id: str, now: float, overrides: dict) -> None:
        if not self.pending:
            self.filler_spoken = False
        self.pending[call.call_id] = PendingCall(call, turn, reply_id, now, overrides)

    @property
    def waiting(self) -> bool:
        return bool(self.pending)

    def oldest(self) -> float | None:
        """When the longest-waiting call was asked."""
        return min((p.asked_at for p in self.pending.values()), default=None)

    def answer(self, call_id: str, output: str, known: bool) -> PendingCall | None:
        """Take a result: the pending call it answers, or None for a call the conversation has but
        does not wait on (one the client added itself: ``known``). Raises ToolResultError."""
        if len(output.encode()) > MAX_RESULT_BYTES:
            raise ToolResultError(E_TOOL_RESULT_TOO_LARGE, f"a tool's output is at most {MAX_RESULT_BYTES} bytes "
                                                           f"(UTF-8); this one has {len(output.encode())}")
        pending = self.pending.pop(call_id, None)
        if pending is not None:
            self._end(call_id, ANSWERED)
            return pending
        ended = self._ended.get(call_id)
        if ended in (CANCELLED, TIMED_OUT):
            raise ToolResultError("call_cancelled", f"call {call_id!r} was {ended}; its result is not used")
        if ended == ANSWERED:
            raise ToolResultError("call_already_answered", f"call {call_id!r} already has its result")
        if not known:
            raise ToolResultError("unknown_call", f"no tool call {call_id!r} in this conversation")
        return None

    def end_all(self, how: str) -> list[PendingCall]:
        """Every pending call ends (the user spoke over them, or they all timed out)."""
        ended, self.pending = list(self.pending.values()), {}
        for p in ended:
            self._end(p.call.call_id, how)
        return ended

    def _end(self, call_id: str, how: str) -> None:
        self._ended[call_id] = how
        while len(self._ended) > self._remember:
            self._ended.popitem(last=False)
