"""Phone calls against `serve run` with auth on and the carriers' accounts set (conftest.py): the
Twilio webhook answers only requests Twilio signed, once; the ticket in its TwiML opens one media
stream; an agent's end_call hangs up through each carrier's REST API (a local fake, reached by the
official clients in the server). Signatures are made here from Twilio's documentation."""
from __future__ import annotations

import asyncio
import xml.etree.ElementTree as ET

import httpx

from load.phone import Phone
from tests.e2e.serve_process import PORT
from tests.e2e_auth.conftest import TWILIO_ACCOUNT_SID, TWILIO_AUTH_TOKEN
from tests.test_twilio_webhook import twilio_signature

BASE = f"https://127.0.0.1:{PORT}"
WEBHOOK = f"{BASE}/v1/phone/twilio/voice?agent=hangs_up"


def _form(call_sid: str) -> dict[str, str]:
    return {"CallSid": call_sid, "AccountSid": TWILIO_ACCOUNT_SID, "From": "+15550002222", "To": "+15550003333",
            "CallStatus": "ringing", "Direction": "inbound", "ApiVersion": "2010-04-01"}


async def _call(url: str, parameters: dict, provider: str = "twilio", address: str = "127.0.0.41") -> Phone:
    async with Phone(url, provider, parameters, local_address=address) as phone:
        await phone.wait(lambda p: p.close_code is not None, 60)
        return phone


def test_the_webhook_answers_signed_calls_once_and_its_ticket_opens_one_stream_that_the_agent_hangs_up(auth_server):
    api = auth_server.carrier_api
    form = _form("CA" + "1" * 32)
    signature = twilio_signature(TWILIO_AUTH_TOKEN, WEBHOOK, form)
    with httpx.Client(transport=httpx.HTTPTransport(local_address="127.0.0.41"), timeout=30) as client:
        post = lambda sig: client.post(WEBHOOK, data=form, headers={"X-Twilio-Signature": sig} if sig else {})  # noqa: E731
        answered = post(signature)
        replayed = post(signature)
        forged = post(twilio_signature("not-the-token", WEBHOOK, form))
        unsigned = post(None)
    assert answered.status_code == 200 and answered.headers["content-type"].startswith("application/xml")
    assert [r.status_code for r in (replayed, forged, unsigned)] == [403, 403, 403]
    assert "replay" in replayed.json()["error"]["message"]
    stream = ET.fromstring(answered.text).find("Connect/Stream")
    params = {p.get("name"): p.get("value") for p in stream.findall("Parameter")}
    assert stream.get("url") == f"wss://127.0.0.1:{PORT}/v1/phone/twilio" and params["agent"] == "hangs_up"

    first = asyncio.run(_call(stream.get("url"), params))
    again = asyncio.run(_call(stream.get("url"), params))
    assert (first.close_code, first.close_reason) == (1000, "call ended by the agent")
    assert (again.close_code, again.close_reason) == (1008, "unauthorized")  # the ticket was used
    hang_ups = [r for r in api.requests if r[1] == f"/2010-04-01/Accounts/{TWILIO_ACCOUNT_SID}/Calls/{first.call_id}.json"]
    assert [fields for _, _, fields in hang_ups] == [{"Status": "completed"}]


def test_a_telnyx_call_with_the_bearer_token_is_hung_up_through_telnyxs_api(auth_server):
    api = auth_server.carrier_api
    phone = asyncio.run(_call(f"wss://127.0.0.1:{PORT}/v1/phone/telnyx",
                              {"ticket": auth_server.token, "agent": "hangs_up"}, "telnyx", "127.0.0.42"))
    assert (phone.close_code, phone.close_reason) == (1000, "call ended by the agent")
    assert ("POST", f"/v2/calls/{phone.call_id}/actions/hangup", {}) in api.requests
    refused = asyncio.run(_call(f"wss://127.0.0.1:{PORT}/v1/phone/telnyx", {"ticket": "not-a-token"}, "telnyx",
                                "127.0.0.42"))
    assert (refused.close_code, refused.close_reason) == (1008, "unauthorized")
