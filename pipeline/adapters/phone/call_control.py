"""Call control from the agent: the built-in call tools' schemas, and the carriers' REST APIs that
carry them out, through each carrier's official client (``twilio``, ``telnyx``).

``end_call`` hangs up once the reply that called it has played; ``transfer_call(to)`` dials one of
the agent's configured numbers (``transfer_to``; the schema's enum, so a model cannot name another);
``collect_digits`` waits for keys (an agent with ``dtmf: tool``). A carrier's base URL is
configurable: tests point it at a local fake of the API (docs/phone.md).
"""
from __future__ import annotations

import asyncio
from typing import Protocol

from pipeline.conversation.keypad import MAX_DIGITS

CALL_CONTROL_TIMEOUT_S = 5.0  # a carrier's REST call answers within this, or the action failed


class CallControlError(Exception):
    """The carrier refused the action or did not answer in time."""


def tool_schemas(names: tuple[str, ...], transfer_to: tuple[str, ...] = ()) -> tuple[dict, ...]:
    """The OpenAI function tools (as a session's ``tools`` holds them) of the named call tools."""
    schemas = {
        "end_call": {"type": "function", "name": "end_call",
                     "description": "Hang up the phone call once what you are saying now has been heard. "
                                    "Say goodbye before calling it.",
                     "parameters": {"type": "object", "properties": {}, "additionalProperties": False}},
        "transfer_call": {"type": "function", "name": "transfer_call",
                          "description": "Transfer the caller to another line once what you are saying now has "
                                         "been heard.",
                          "parameters": {"type": "object", "properties": {
                              "to": {"type": "string", "enum": list(transfer_to),
                                     "description": "the number or SIP address to transfer to"}},
                              "required": ["to"], "additionalProperties": False}},
        "collect_digits": {"type": "function", "name": "collect_digits",
                           "description": "Wait for the caller to type digits on the keypad; the result is the "
                                          "digits, ended by # or when max_digits have been typed.",
                           "parameters": {"type": "object", "properties": {
                               "max_digits": {"type": "integer", "minimum": 1, "maximum": MAX_DIGITS}},
                               "required": ["max_digits"], "additionalProperties": False}},
    }
    return tuple(schemas[n] for n in names)


def require_carrier_client(name: str):
    """A carrier's official client (the ``phone`` extra), imported where its account is configured;
    a clear error where it is not installed."""
    import importlib

    try:
        module = importlib.import_module(name)
        if name == "twilio":
            importlib.import_module("twilio.twiml.voice_response")
        return module
    except ImportError:
        raise RuntimeError(f"phone.{name} is configured but the {name} package is not installed: "
                           "pip install 'gapless[phone]'") from None


class CallControl(Protocol):
    async def hang_up(self, call_id: str) -> None: ...
    async def transfer(self, call_id: str, to: str) -> None: ...


class TwilioCalls:
    """Twilio's Calls resource: hang up by setting the call ``completed``; transfer by replacing its
    TwiML with ``<Dial>`` (the media stream then ends)."""

    def __init__(self, account_sid: str, auth_token: str, api_base_url: str | None = None):
        twilio = require_carrier_client("twilio")
        from twilio.base.exceptions import TwilioException
        from twilio.http.async_http_client import AsyncTwilioHttpClient
        from twilio.rest import Client

        self.errors = (TwilioException, OSError, TimeoutError)
        self.dial_twiml = twilio.twiml.voice_response.VoiceResponse
        self.client = Client(account_sid, auth_token, http_client=AsyncTwilioHttpClient(timeout=CALL_CONTROL_TIMEOUT_S))
        if api_base_url:
            self.client.api.base_url = api_base_url.rstrip("/")

    async def _update(self, call_id: str, **fields) -> None:
        try:
            async with asyncio.timeout(CALL_CONTROL_TIMEOUT_S):
                await self.client.calls(call_id).update_async(**fields)
        except self.errors as exc:
            raise CallControlError(f"Twilio: {exc}") from None

    async def hang_up(self, call_id: str) -> None:
        await self._update(call_id, status="completed")

    async def transfer(self, call_id: str, to: str) -> None:
        twiml = self.dial_twiml()
        twiml.dial(to)
        await self._update(call_id, twiml=str(twiml))


class TelnyxCalls:
    """Telnyx Call Control: the call's ``hangup`` and ``transfer`` actions."""

    def __init__(self, api_key: str, api_base_url: str | None = None):
        telnyx = require_carrier_client("telnyx")  # a large package: imported only where its account is set

        self.errors = (telnyx.APIError, OSError, TimeoutError)
        self.client = telnyx.AsyncTelnyx(api_key=api_key, base_url=api_base_url, timeout=CALL_CONTROL_TIMEOUT_S,
                                          max_retries=1)

    async def _act(self, action, call_id: str, **fields) -> None:
        try:
            async with asyncio.timeout(CALL_CONTROL_TIMEOUT_S):
                await action(call_id, **fields)
        except self.errors as exc:
            raise CallControlError(f"Telnyx: {exc}") from None

    async def hang_up(self, call_id: str) -> None:
        await self._act(self.client.calls.actions.hangup, call_id)

    async def transfer(self, call_id: str, to: str) -> None:
        await self._act(self.client.calls.actions.transfer, call_id, to=to)

