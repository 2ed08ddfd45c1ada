"""Twilio's voice webhook: a call comes in, Twilio asks this server what to do, and the answer is
TwiML that connects the call's audio to ``/v1/phone/twilio`` (``<Connect><Stream>``).

The request must carry a good ``X-Twilio-Signature`` (checked by the ``twilio`` package's
``RequestValidator`` against the URL Twilio called and the form it posted), and is answered once:
Twilio signs no time, so a signature seen within ``replay_window_s`` is a replay (refused 403). The
record of signatures seen is the one every gateway replica shares (the ticket ledger's claims).
The stream's credential is a fresh one-use ticket in a ``<Parameter>`` (a carrier's stream carries
no headers of ours); the call's ``agent`` and ``voice``, from the webhook URL's query, ride along.
"""
from __future__ import annotations

import hashlib
import time
from typing import Awaitable, Callable
from urllib.parse import urlsplit

from pipeline.adapters.phone.call_control import require_carrier_client

CALL_PARAMETERS = ("agent", "voice")  # what the webhook's query may pass on to the call


class WebhookRefused(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status, self.message = status, message


def stream_url(public_url: str | None, request_url: str, carrier: str = "twilio") -> str:
    """The media stream's wss:// URL: on ``public_url`` if configured, else on the URL the
    request came to (http -> ws, https -> wss)."""
    base = urlsplit(public_url or request_url)
    scheme = "wss" if base.scheme == "https" else "ws"
    return f"{scheme}://{base.netloc}/v1/phone/{carrier}"


def signed_url(public_url: str | None, request_url: str) -> str:
    """The URL Twilio signed: what it called (``public_url``'s origin behind a proxy), path and query."""
    if public_url is None:
        return request_url
    called, public = urlsplit(request_url), urlsplit(public_url)
    return f"{public.scheme}://{public.netloc}{called.path}" + (f"?{called.query}" if called.query else "")


class TwilioWebhook:
    def __init__(self, auth_token: str, claim: Callable[[str, float], Awaitable[bool]], issue: Callable[[], str],
                 replay_window_s: float, clock: Callable[[], float] = time.time):
        require_carrier_client("twilio")
        from twilio.request_validator import RequestValidator

        self.validator = RequestValidator(auth_token)
        self.claim, self.issue, self.replay_window_s, self.clock = claim, issue, replay_window_s, clock

    async def answer(self, url: str, form: dict[str, str], signature: str | None, stream: str,
                     query: dict[str, str]) -> str:
        """The TwiML for a call whose webhook request is ``url`` + ``form``, signed ``signature``;
        raises WebhookRefused (403) for a missing, forged or replayed signature."""
        if not signature:
            raise WebhookRefused(403, "X-Twilio-Signature is missing")
        if not self.validator.validate(url, form, signature):
            raise WebhookRefused(403, "X-Twilio-Signature does not match this request (check phone.public_url: "
                                      "it must be the URL Twilio calls)")
        nonce = "twilio-webhook." + hashlib.sha256(signature.encode()).hexdigest()
        if not await self.claim(nonce, self.clock() + self.replay_window_s):
            raise WebhookRefused(403, "this signed request was answered already (a replay)")
        return self.twiml(stream, self.issue(), {k: query[k] for k in CALL_PARAMETERS if query.get(k)})

    @staticmethod
    def twiml(stream: str, ticket: str, parameters: dict[str, str]) -> str:
        from twilio.twiml.voice_response import Connect, VoiceResponse

        response, connect = VoiceResponse(), Connect()
        media = connect.stream(url=stream)
        media.parameter(name="ticket", value=ticket)
        for name, value in parameters.items():
            media.parameter(name=name, value=value)
        response.append(connect)
        return str(response)
