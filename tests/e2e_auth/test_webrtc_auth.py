"""WebRTC calls with auth on (conftest.py): a browser's ephemeral key from
/v1/realtime/client_secrets opens one call, as OpenAI's does; no credential and a used key get
401; a client's calls count against its session cap (429 past it)."""
from __future__ import annotations

import asyncio

import httpx

from load.webrtc_client import RtcCall
from tests.e2e.serve_process import PORT
from tests.e2e_auth.conftest import MAX_SESSIONS_PER_CLIENT

BASE = f"https://127.0.0.1:{PORT}"


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 120))


async def _offer(call: RtcCall) -> httpx.Response:
    """The call's offer POSTed, without applying the answer."""
    call.pc.addTrack(call.mic)
    call.pc.createDataChannel("oai-events")
    await call.pc.setLocalDescription(await call.pc.createOffer())
    try:
        return await call.post_offer(call.pc.localDescription.sdp)
    finally:
        await call.pc.close()


def test_an_ephemeral_key_opens_one_call_and_no_key_opens_none(auth_server):
    addr = "127.0.0.51"
    with httpx.Client(transport=httpx.HTTPTransport(local_address=addr), timeout=30) as client:
        secret = client.post(f"{BASE}/v1/realtime/client_secrets", json={"session": {"type": "realtime"}},
                             headers={"Authorization": f"Bearer {auth_server.token}"})
        refused = client.post(f"{BASE}/v1/realtime/client_secrets", json={})
    assert secret.status_code == 200 and refused.status_code == 401
    key = secret.json()["value"]
    assert auth_server.token not in key and secret.json()["expires_at"] > 0

    async def go():
        async with RtcCall(BASE, credential=key, local_address=addr) as call:
            await call.wait(lambda c: c.of("session.created"))
        again = await _offer(RtcCall(BASE, credential=key, local_address=addr))
        anonymous = await _offer(RtcCall(BASE, local_address=addr))
        return call, again, anonymous

    call, again, anonymous = run(go())
    assert call.of("session.created")
    assert (again.status_code, again.json()["code"]) == (401, "unauthorized")
    assert (anonymous.status_code, anonymous.json()["code"]) == (401, "unauthorized")


def test_a_clients_calls_count_against_its_session_cap(auth_server):
    addr = "127.0.0.52"

    async def go():
        calls = [RtcCall(BASE, credential=auth_server.token, local_address=addr)
                 for _ in range(MAX_SESSIONS_PER_CLIENT)]
        for call in calls:
            await call.__aenter__()
        try:
            over = await _offer(RtcCall(BASE, credential=auth_server.token, local_address=addr))
        finally:
            for call in calls:
                await call.close()
        return over

    over = run(go())
    assert (over.status_code, over.json()["code"]) == (429, "too_many_sessions")
