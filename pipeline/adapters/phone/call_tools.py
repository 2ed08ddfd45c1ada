"""The agent's built-in call tools on one phone call (``pipeline/adapters/phone/call_control.py``),
translated: the LLM asks (``ask``), and between frames (``run_asked``) each call becomes the
conversation's commands, which hold the rules:

- ``end_call`` and ``transfer_call(to)`` answer at once ("close": nothing more is said) and
  ``EndCall``: the conversation says when the call is over (``CallOver``: its last words have played,
  or ``hang_up_within_s`` passed), and :meth:`CallTools.finish` then acts through the carrier's
  REST API;
- ``collect_digits(max_digits)`` is ``CollectDigits``: the conversation's keypad answers it with the
  keys the caller types (an agent with ``dtmf: tool`` sends its keys there, not as turns).
"""
from __future__ import annotations

import json
import logging
from typing import Any, Awaitable, Callable

from pipeline.adapters.phone.call_control import CallControl, CallControlError
from pipeline.adapters.phone.config import PhoneAgent, PhoneConfig
from pipeline.conversation import commands as C
from pipeline.conversation.calls import ToolResultError
from pipeline.conversation.keypad import MAX_DIGITS
from pipeline.conversation.observer import Observer
from pipeline.engines import ToolCall

log = logging.getLogger(__name__)
E_CALL_CONTROL = "call_control_failed"


class CallTools:
    def __init__(self, do: Callable[[C.Command], Awaitable[Any]], phone: PhoneConfig, calls: CallControl | None,
                 wake: Callable[[], None], observer: Observer):
        self.do, self.phone, self.calls, self.wake, self.observer = do, phone, calls, wake, observer
        self.agent = PhoneAgent()  # the call's agent (set at the call's start)
        self.asked: list[ToolCall] = []  # calls the LLM made, run between frames (outside the reply)

    def ask(self, call: ToolCall) -> None:
        self.asked.append(call)
        self.wake()  # the receive loop runs it at once

    def next_deadline(self, now: float) -> float | None:
        return now if self.asked else None

    async def key(self, key: str) -> None:
        """A key the caller pressed: a user turn, or (``dtmf: tool``) kept for collect_digits."""
        await self.do(C.Digits(key, as_turn=self.agent.dtmf == "turn"))

    async def run_asked(self) -> None:
        while self.asked:
            await self._run(self.asked.pop(0))

    async def finish(self, call_id: str, transfer_to: str | None) -> str:
        """Hang up or transfer through the carrier's API; what happened, for the stream's close.
        Without an account, the stream's close is the hang-up (Twilio ends a call whose TwiML has
        no verb after ``<Connect>``)."""
        try:
            if self.calls is not None and transfer_to is not None:
                await self.calls.transfer(call_id, transfer_to)
            elif self.calls is not None:
                await self.calls.hang_up(call_id)
        except CallControlError as exc:
            self.observer.error(E_CALL_CONTROL)
            log.warning("call %s: %s failed: %s", call_id, "transfer" if transfer_to else "hang-up", exc)
        return f"transferred to {transfer_to}" if transfer_to else "ended by the agent"

    async def _run(self, call: ToolCall) -> None:
        try:
            args = json.loads(call.arguments or "{}")
        except ValueError:
            args = {}
        args = args if isinstance(args, dict) else {}
        within_s = self.phone.hang_up_within_s
        if call.name == "collect_digits":
            count = args.get("max_digits")
            await self.do(C.CollectDigits(call.call_id, count if isinstance(count, int) and not isinstance(count, bool)
                                          else MAX_DIGITS))
        elif call.name == "end_call":
            if await self._result(call.call_id, "The call ends once this reply has played.", "close"):
                await self.do(C.EndCall(within_s))
        elif call.name == "transfer_call" and args.get("to") in self.agent.transfer_to and self.calls is not None:
            if await self._result(call.call_id, f"The call is transferred to {args['to']} once this reply has "
                                                "played.", "close"):
                await self.do(C.EndCall(within_s, args["to"]))
        else:
            why = "this call cannot be transferred" if call.name == "transfer_call" else "no such tool on this call"
            await self._result(call.call_id, f"error: {why}", "respond")

    async def _result(self, call_id: str, output: str, then: str) -> bool:
        try:
            await self.do(C.ToolResult(call_id, output, then))
            return True
        except ToolResultError as exc:  # the caller spoke over it: the call was cancelled
            log.info("result of %s not used: %s", call_id, exc.message)
            return False
