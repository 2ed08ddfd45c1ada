"""Tool calls in a conversation: the LLM asks, the client runs them and answers, and what follows
once they settle (a reply that uses the results, nothing, or a reply that says they timed out).

:class:`ToolFlow` keeps the calls (``pipeline/conversation/calls.py``) and their history items, and says what
is due; the replies act on it. While results are awaited the turn's response stays open.
"""
from __future__ import annotations

from dataclasses import dataclass

from pipeline.conversation.calls import CANCELLED, TIMED_OUT, PendingCall, ToolCalls
from pipeline.conversation.shared import Shared
from pipeline.engines import ToolCall
from pipeline.conversation.history import Item


@dataclass(frozen=True)
class FollowUp:
    """What follows settled calls: "respond", "close" (an empty reply ends the response),
    "timeout" (the configured timeout reply) or "filler" (said while waiting; not recorded)."""

    then: str
    overrides: dict


class ToolFlow:
    def __init__(self, shared: Shared):
        self.shared = shared
        self.calls = ToolCalls()
        self.follow_up: FollowUp | None = None  # due once no other reply runs

    @property
    def waiting(self) -> bool:
        return self.calls.waiting

    @property
    def awaiting(self) -> bool:
        """Calls are pending, or their results are in and a reply is about to follow: the response
        of the turn goes on."""
        return self.calls.waiting or self.follow_up is not None

    def ask(self, call: ToolCall, turn: int, reply_id: str, overrides: dict) -> Item:
        """The LLM called a tool: the call joins the history now."""
        self.calls.ask(call, turn, reply_id, self.shared.clock(), overrides)
        return self.shared.history.add(Item.call(call.call_id, call.name, call.arguments))

    def answer(self, call_id: str, output: str, then: str | None) -> Item:
        """The client's result (raises calls.ToolResultError, changing nothing); the last pending
        call's result sets what follows (``then``; None: the client asks for a reply itself)."""
        history = self.shared.history
        pending = self.calls.answer(call_id, output, known=history.call(call_id) is not None)
        item = history.add(Item.output(call_id, output))
        if pending is not None and not self.calls.waiting and then is not None:
            self.follow_up = FollowUp(then, pending.overrides)
        return item

    def cancel_all(self) -> list[PendingCall]:
        """The user spoke over pending calls (or their reply was cancelled): their results are not
        waited for; the history records that."""
        ended = self.calls.end_all(CANCELLED)
        for p in ended:
            self.shared.history.add(Item.output(p.call.call_id, "cancelled: the user spoke before the result came"))
        self.follow_up = None
        return ended

    def deadline(self) -> float | None:
        oldest = self.calls.oldest()
        if oldest is None:
            return None
        due = oldest + self.shared.cfg.tool_timeout_s
        agent = self.shared.agent
        if agent.tool_filler and not self.calls.filler_spoken:
            due = min(due, oldest + agent.tool_filler_after_ms / 1000)
        return due

    def due(self, reply_running: bool) -> tuple[list[PendingCall], FollowUp | None]:
        """Calls past ``tool_timeout_s`` end (their reply says so: the follow-up); past the filler
        delay, the filler is due once while nothing else plays."""
        oldest = self.calls.oldest()
        if oldest is None:
            return [], None
        now, cfg, agent = self.shared.clock(), self.shared.cfg, self.shared.agent
        if now >= oldest + cfg.tool_timeout_s:
            ended = self.calls.end_all(TIMED_OUT)
            for p in ended:
                self.shared.history.add(Item.output(p.call.call_id, f"error: no result within {cfg.tool_timeout_s:g} s"))
            self.follow_up = FollowUp("timeout", ended[-1].overrides if ended else {})
            return ended, None
        if agent.tool_filler and not self.calls.filler_spoken and not reply_running \
                and now >= oldest + agent.tool_filler_after_ms / 1000:
            self.calls.filler_spoken = True
            return [], FollowUp("filler", {})
        return [], None
