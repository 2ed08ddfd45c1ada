"""The agent's built-in call tools on one phone call (``pipeline/adapters/phone/call_control.py``), run between
frames: the LLM asks (``ask``), the phone adapter runs what was asked at its next deadline check.

- ``end_call`` and ``transfer_call(to)`` answer at once ("close": nothing more is said) and end
  the call once the reply has played (the adapter says when: its last mark echoed), or after
  ``hang_up_within_s`` at the latest, through the carrier's REST API.
- ``collect_digits(max_digits)`` is answered by keys (an agent with ``dtmf: tool``): the digits
  typed up to ``#``, or ``max_digits`` of them. Keys typed before the call are kept for it.
"""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Callable

from pipeline.adapters.phone.call_control import MAX_DIGITS, CallControl, CallControlError
from pipeline.conversation.calls import ToolResultError
from pipeline.conversation import commands as C
from pipeline.conversation.core import Conversation
from pipeline.engines import ToolCall
from pipeline.adapters.phone.config import PhoneAgent, PhoneConfig

log = logging.getLogger(__name__)
E_CALL_CONTROL = "call_control_failed"


@dataclass(frozen=True)
class Ending:
    """The agent ended the call: ``transfer`` to ``to``, else hang up; at ``by`` at the latest."""

    to: str | None
    by: float


class CallTools:
    def __init__(self, core: Conversation, phone: PhoneConfig, calls: CallControl | None, clock: Callable[[], float]):
        self.core, self.phone, self.calls, self.clock = core, phone, calls, clock
        self.agent = PhoneAgent()  # the call's agent (set at the call's start)
        self.asked: list[ToolCall] = []  # calls the LLM made, run between frames
        self.keys = ""  # keys typed for collect_digits
        self.collecting: tuple[str, int] | None = None  # (call id, max digits) of a collect_digits call
        self.ending: Ending | None = None

    def ask(self, call: ToolCall) -> None:
        self.asked.append(call)
        self.core.deadline_changed.set()  # the receive loop runs it at once, outside the reply

    def cancelled(self, call_id: str) -> None:
        if self.collecting and self.collecting[0] == call_id:
            self.collecting = None

    def next_deadline(self, played: bool) -> float | None:
        """Now, with calls to run or a call to end (``played``: the caller has heard all that was
        sent); the ending's latest time; else None."""
        if self.asked or self.ends_now(played):
            return self.clock()
        return self.ending.by if self.ending is not None else None

    def ends_now(self, played: bool) -> bool:
        """The agent ended the call and its last words have played (or its time is up)."""
        return self.ending is not None and (
            (played and not self.core.replies.running) or self.clock() >= self.ending.by)

    async def key(self, key: str) -> None:
        """A key the caller pressed: a user turn, or (``dtmf: tool``) the collect_digits tool's."""
        if self.agent.dtmf == "turn":
            await self.core.do(C.Digits(key))
            return
        self.keys = (self.keys + key)[-2 * MAX_DIGITS:]
        await self._collect()

    async def run_asked(self) -> None:
        while self.asked:
            await self._run(self.asked.pop(0))

    async def end_call(self, call_id: str) -> str:
        """Hang up or transfer through the carrier's API; what happened, for the stream's close.
        Without an account, the stream's close is the hang-up (Twilio ends a call whose TwiML has
        no verb after ``<Connect>``)."""
        ending, self.ending = self.ending, None
        try:
            if self.calls is not None and ending.to is not None:
                await self.calls.transfer(call_id, ending.to)
            elif self.calls is not None:
                await self.calls.hang_up(call_id)
        except CallControlError as exc:
            self.core.shared.observer.error(E_CALL_CONTROL)
            log.warning("call %s: %s failed: %s", call_id, "transfer" if ending.to else "hang-up", exc)
        return f"transferred to {ending.to}" if ending.to else "ended by the agent"

    async def _run(self, call: ToolCall) -> None:
        try:
            args = json.loads(call.arguments or "{}")
        except ValueError:
            args = {}
        args = args if isinstance(args, dict) else {}
        by = self.clock() + self.phone.hang_up_within_s
        if call.name == "collect_digits":
            count = args.get("max_digits")
            self.collecting = (call.call_id, min(max(count, 1), MAX_DIGITS) if isinstance(count, int) else MAX_DIGITS)
            await self._collect()
        elif call.name == "end_call":
            if await self._result(call.call_id, "The call ends once this reply has played.", "close"):
                self.ending = Ending(None, by)
        elif call.name == "transfer_call" and args.get("to") in self.agent.transfer_to and self.calls is not None:
            if await self._result(call.call_id, f"The call is transferred to {args['to']} once this reply has "
                                                "played.", "close"):
                self.ending = Ending(args["to"], by)
        else:
            why = "this call cannot be transferred" if call.name == "transfer_call" else "no such tool on this call"
            await self._result(call.call_id, f"error: {why}", "respond")

    async def _collect(self) -> None:
        """A collect_digits call has its result once # is pressed or its digits are all typed."""
        if self.collecting is None:
            return
        call_id, count = self.collecting
        head, hash_key, tail = self.keys.partition("#")
        if len(head) >= count:
            digits, self.keys = head[:count], self.keys[count:]
        elif hash_key:
            digits, self.keys = head, tail
        else:
            return
        self.collecting = None
        await self._result(call_id, digits or "(no digits: the caller pressed # alone)", "respond")

    async def _result(self, call_id: str, output: str, then: str) -> bool:
        try:
            await self.core.do(C.ToolResult(call_id, output, then))
            return True
        except ToolResultError as exc:  # the caller spoke over it: the call was cancelled
            log.info("session %s: result of %s not used: %s", self.core.id, call_id, exc.message)
            return False
