"""Authentication and per-client limits through the real app (`serve run` with auth on):
refusals are HTTP answers to the handshake, before any WebSocket or session exists."""
from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path

import httpx
import pytest
import websockets

from load import browser
from load.client import Conversation
from pipeline.adapters.v1 import protocol as P
from tests.e2e.serve_process import PORT
from tests.e2e_auth.conftest import HANDSHAKES_PER_MINUTE, MAX_SESSIONS_PER_CLIENT

BASE = f"https://127.0.0.1:{PORT}"  # the auth server serves TLS only (conftest.py)
URL = f"wss://127.0.0.1:{PORT}/v1/conversation?turn_detection=manual"


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 120))


async def handshake(address: str, headers: dict | None = None, url: str = URL) -> tuple[int, dict]:
    """(101, session.ready) for an admitted handshake, else (HTTP status, JSON body)."""
    try:
        async with websockets.connect(url, additional_headers=headers, local_addr=(address, 0)) as ws:
            return 101, P.unpack(await asyncio.wait_for(ws.recv(), 30))
    except websockets.InvalidStatus as exc:
        return exc.response.status_code, json.loads(bytes(exc.response.body))


def http(address: str) -> httpx.Client:
    return httpx.Client(base_url=BASE, transport=httpx.HTTPTransport(local_address=address), timeout=30)


def metric(name: str, token: str) -> float:
    text = httpx.get(f"{BASE}/metrics", headers={"Authorization": f"Bearer {token}"}, timeout=30).text
    found = re.search(rf"^{name}(?:\{{[^}}]*\}})? (\S+)$", text, flags=re.M)
    return float(found.group(1)) if found else 0.0


def test_a_handshake_needs_a_valid_token(auth_server):
    addr, token = "127.0.0.11", auth_server.token
    status, body = run(handshake(addr))
    assert (status, body["code"]) == (401, "unauthorized")
    status, body = run(handshake(addr, {"Authorization": f"Bearer {token[:-2]}xx"}))
    assert (status, body["code"]) == (401, "unauthorized")
    assert token[:-2] not in json.dumps(body)
    status, ready = run(handshake(addr, {"Authorization": f"Bearer {token}"}))
    assert (status, ready["type"]) == (101, "session.ready")


def test_the_realtime_endpoint_needs_the_token_too(auth_server):
    """/v1/realtime has v1's door: without the token, or with a wrong one (what the openai SDK
    sends as its API key), the handshake is refused with 401 before any upgrade; with it, the
    official SDK's client gets session.created."""
    from load.realtime_client import RealtimeConversation

    addr, token = "127.0.0.17", auth_server.token
    url = f"wss://127.0.0.1:{PORT}/v1/realtime?model=gapless"
    for headers in (None, {"Authorization": "Bearer not-the-token-at-all"}):
        try:
            run(websockets.connect(url, additional_headers=headers, local_addr=(addr, 0)))
            status, body = 101, {}
        except websockets.InvalidStatus as exc:
            status, body = exc.response.status_code, json.loads(bytes(exc.response.body))
        assert (status, body.get("code")) == (401, "unauthorized")

    async def with_sdk():
        async with RealtimeConversation(url, token=token) as conv:
            return conv.ready["type"], conv.errors

    assert run(with_sdk()) == ("session.created", [])


def test_refused_handshakes_allocate_nothing(auth_server):
    token = auth_server.token
    opened_before = metric("voice_stt_streams_opened_total", token)

    async def go():
        statuses = [(await handshake("127.0.0.12", {"Origin": "https://evil.example"}))[0] for _ in range(3)]
        statuses += [(await handshake("127.0.0.12"))[0] for _ in range(3)]
        return statuses

    assert run(go()) == [403, 403, 403, 401, 401, 401]
    assert metric("voice_sessions_active", token) == 0
    assert metric("voice_stt_streams_opened_total", token) == opened_before
    assert metric('voice_handshakes_refused_total{code="unauthorized"}', token) >= 3


def test_a_ticket_opens_one_connection(auth_server):
    addr, token = "127.0.0.13", auth_server.token
    with http(addr) as client:
        refused = client.post("/v1/session")
        assert (refused.status_code, refused.json()["code"]) == (401, "unauthorized")
        assert refused.headers["www-authenticate"] == "Bearer"
        issued = client.post("/v1/session", headers={"Authorization": f"Bearer {token}"})
    assert issued.status_code == 200 and issued.headers["cache-control"] == "no-store"
    ticket = issued.json()
    assert ticket["expires_in_s"] == 60 and token not in ticket["ticket"]
    url = f"wss://127.0.0.1:{PORT}{ticket['url']}&turn_detection=manual"
    first, again = run(handshake(addr, url=url)), run(handshake(addr, url=url))
    assert (first[0], first[1]["type"]) == (101, "session.ready")
    assert (again[0], again[1]["code"]) == (401, "unauthorized") and "already used" in again[1]["message"]
    forged = ticket["ticket"][:-4] + ("0000" if not ticket["ticket"].endswith("0000") else "1111")
    status, body = run(handshake(addr, url=f"wss://127.0.0.1:{PORT}/v1/conversation?ticket={forged}"))
    assert (status, body["code"]) == (401, "unauthorized")


def test_a_bearer_token_with_a_bad_ticket_gives_its_place_back(auth_server):
    """A handshake with a good token and a bad ticket is refused (401) and frees its place: more of
    them than the client's cap, then a plain handshake from the same address is still admitted
    (the place leaked before: 429 too_many_sessions until the server restarted)."""
    addr, auth = "127.0.0.27", {"Authorization": f"Bearer {auth_server.token}"}
    bad = f"wss://127.0.0.1:{PORT}/v1/conversation?turn_detection=manual&ticket=not.a.real.ticket"
    refused = [run(handshake(addr, auth, url=bad)) for _ in range(MAX_SESSIONS_PER_CLIENT + 1)]
    assert [(status, body["code"]) for status, body in refused] == [(401, "unauthorized")] * len(refused)
    status, ready = run(handshake(addr, auth))
    assert (status, ready["type"]) == (101, "session.ready")


def test_a_foreign_origin_is_refused(auth_server):
    addr, auth = "127.0.0.14", {"Authorization": f"Bearer {auth_server.token}"}
    status, body = run(handshake(addr, {**auth, "Origin": "https://evil.example"}))
    assert (status, body["code"]) == (403, "origin_not_allowed")
    status, ready = run(handshake(addr, {**auth, "Origin": f"https://127.0.0.1:{PORT}"}))  # the page's own
    assert (status, ready["type"]) == (101, "session.ready")


def test_metrics_need_the_token_and_healthz_does_not(auth_server):
    with http("127.0.0.15") as client:
        assert client.get("/healthz").status_code == 200
        assert client.get("/metrics").status_code == 401
        ok = client.get("/metrics", headers={"Authorization": f"Bearer {auth_server.token}"})
    assert ok.status_code == 200 and "voice_sessions_active" in ok.text


def test_sessions_per_client_are_capped(auth_server):
    token = auth_server.token

    async def go():
        held = [Conversation(URL, token=token, local_addr=("127.0.0.16", 0)) for _ in range(MAX_SESSIONS_PER_CLIENT)]
        for c in held:
            await c.__aenter__()
        try:
            over = await handshake("127.0.0.16", {"Authorization": f"Bearer {token}"})
            other = await handshake("127.0.0.17", {"Authorization": f"Bearer {token}"})  # another client
            reply = await held[0].say_text("Still here?")  # the admitted sessions are unaffected
            await held[-1].__aexit__()
            for _ in range(100):  # the server releases the place when it sees the close
                freed = await handshake("127.0.0.16", {"Authorization": f"Bearer {token}"})
                if freed[0] == 101:
                    break
            return over, other, reply, freed
        finally:
            for c in held[:-1]:
                await c.__aexit__()

    over, other, reply, freed = run(go())
    assert (over[0], over[1]["code"]) == (429, "too_many_sessions")
    assert other[0] == 101
    assert reply.final_text == "Still here?" and reply.interrupted is False
    assert freed[0] == 101


def test_handshakes_per_minute_are_capped(auth_server):
    token = auth_server.token

    async def go():
        early = [(await handshake("127.0.0.18"))[0] for _ in range(HANDSHAKES_PER_MINUTE)]
        over = await handshake("127.0.0.18", {"Authorization": f"Bearer {token}"})  # even with a good token
        other = await handshake("127.0.0.19", {"Authorization": f"Bearer {token}"})
        return early, over, other

    early, over, other = run(go())
    assert early == [401] * HANDSHAKES_PER_MINUTE
    assert (over[0], over[1]["code"]) == (429, "too_many_handshakes")
    assert other[0] == 101


def test_the_page_asks_for_a_token_then_talks(auth_server):
    with browser.Page(f"{BASE}/?mode=manual&transport=websocket", ignore_https_errors=True) as page:  # push-to-talk: the fake microphone stays unsent
        page.connect()
        assert page.state()["status"].startswith("not connected")
        assert page.page.is_visible("#token")
        assert page.state()["errors"][-1]["code"] == "unauthorized"
        page.connect(token=auth_server.token)
        assert page.state()["status"].startswith("connected"), page.state()
        page.type_turn("Hello there.")
        turn = page.wait_turn_done(1)
    assert turn["finalText"] == "Hello there." and turn["interrupted"] is False


@pytest.mark.parametrize("where", ["serve run's output", "Ray's logs"])
def test_no_token_text_in_the_logs(auth_server, where):
    """After every test above, the token appears in no log line (it came from the environment)."""
    if where == "serve run's output":
        files = [Path(auth_server.log_path)]
    else:
        files = [p for p in Path("/tmp/ray/session_latest/logs").rglob("*") if p.is_file()]
    assert files
    leaks = [str(p) for p in files if auth_server.token.encode() in p.read_bytes()]
    assert leaks == []
