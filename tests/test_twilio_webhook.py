"""Twilio's voice webhook (pipeline/adapters/phone/twilio_webhook.py), in-process: signatures are made here as
Twilio's documentation says (HMAC-SHA1 of the URL and the sorted form, base64), not with the
library the server checks them with."""
from __future__ import annotations

import asyncio
import base64
import hashlib
import hmac
import xml.etree.ElementTree as ET

import pytest

from pipeline.door.auth import AuthConfig, AuthError, Authenticator, LocalRedeemed
from pipeline.adapters.phone.twilio_webhook import TwilioWebhook, WebhookRefused, signed_url, stream_url

TOKEN = "twilio-auth-token-0123456789abcdef"
URL = "https://voice.example.com/v1/phone/twilio/voice?agent=support"
FORM = {"CallSid": "CA0123", "AccountSid": "AC0123", "From": "+15550002222", "To": "+15550003333",
        "CallStatus": "ringing", "Direction": "inbound"}


def twilio_signature(token: str, url: str, form: dict[str, str]) -> str:
    """twilio.com/docs/usage/webhooks/webhooks-security: the URL, then each POST field's name and
    value sorted by name, HMAC-SHA1 with the auth token, base64."""
    data = url + "".join(k + form[k] for k in sorted(form))
    return base64.b64encode(hmac.new(token.encode(), data.encode(), hashlib.sha1).digest()).decode()


def _webhook(auth: Authenticator) -> TwilioWebhook:
    seen = LocalRedeemed()

    async def claim(nonce: str, until: float) -> bool:
        return seen.claim(nonce, until)

    return TwilioWebhook(TOKEN, claim, lambda: auth.issue()[0], replay_window_s=3600)


def test_a_signed_call_gets_twiml_with_a_one_use_ticket_and_replays_forgeries_and_unsigned_are_refused():
    """Each refusal is tried on a webhook of its own (a fresh replay record), so a replay cannot
    mask a validator that ignores the URL or the form, and each is refused for its own reason.
    The same changes, signed for what they are, are answered: the signature covers them."""
    auth = Authenticator(AuthConfig(mode="token"), ("server-token-" + "x" * 32,))
    stream = stream_url("https://voice.example.com", URL)
    good = twilio_signature(TOKEN, URL, FORM)
    changed_form, other_url = {**FORM, "From": "+15559999999"}, URL.replace("support", "sales")

    async def answer(hook, url, form, signature):
        try:
            await hook.answer(url, form, signature, stream, {})
            return "answered"
        except WebhookRefused as refused:
            return refused.status, refused.message

    async def go():
        hook = _webhook(auth)
        answers = {"signed": await hook.answer(URL, FORM, good, stream, {"agent": "support", "other": "x"}),
                   "replayed": await answer(hook, URL, FORM, good)}
        for name, (url, form, signature) in {
            "forged": (URL, FORM, twilio_signature("another-token", URL, FORM)),
            "changed form": (URL, changed_form, good),  # signed for FORM, posted with another From
            "another URL": (other_url, FORM, good),  # signed for URL, posted to another
            "missing": (URL, FORM, None),
            "changed form, signed for it": (URL, changed_form, twilio_signature(TOKEN, URL, changed_form)),
            "another URL, signed for it": (other_url, FORM, twilio_signature(TOKEN, other_url, FORM)),
        }.items():
            answers[name] = await answer(_webhook(auth), url, form, signature)
        return answers

    answers = asyncio.run(go())
    reasons = {k: (v[0], v[1].split(" (")[0]) for k, v in answers.items() if isinstance(v, tuple)}
    mismatch = (403, "X-Twilio-Signature does not match this request")
    assert reasons == {"replayed": (403, "this signed request was answered already"), "forged": mismatch,
                       "changed form": mismatch, "another URL": mismatch,
                       "missing": (403, "X-Twilio-Signature is missing")}
    assert answers["changed form, signed for it"] == answers["another URL, signed for it"] == "answered"
    stream_el = ET.fromstring(answers["signed"]).find("Connect/Stream")
    assert stream_el.get("url") == "wss://voice.example.com/v1/phone/twilio"
    params = {p.get("name"): p.get("value") for p in stream_el.findall("Parameter")}
    assert set(params) == {"ticket", "agent"} and params["agent"] == "support"
    auth.redeem(params["ticket"])  # the credential opens one stream...
    with pytest.raises(AuthError):
        auth.redeem(params["ticket"])  # ...and only one


def test_the_signed_url_is_the_public_one_behind_a_proxy():
    inner = "http://10.0.0.5:8000/v1/phone/twilio/voice?agent=a"
    assert signed_url("https://voice.example.com", inner) == "https://voice.example.com/v1/phone/twilio/voice?agent=a"
    assert signed_url(None, inner) == inner
    assert stream_url(None, inner) == "ws://10.0.0.5:8000/v1/phone/twilio"
