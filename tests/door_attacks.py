"""The phone and WebRTC doors tried as an anonymous attacker would, against a served app, beside a
victim v1 conversation and a /healthz probe (tests/e2e/test_door.py runs them with auth off,
tests/e2e_auth/test_door_phone_webrtc.py with auth on). Each attack returns what the attacker
saw; the tests assert that the doors held and that the victim was served as if alone."""
from __future__ import annotations

import asyncio
import json
import re
import ssl
import time
from dataclasses import dataclass, field

import httpx
import websockets
from aiortc import RTCPeerConnection

from load.client import Conversation
from pipeline.door import bodies
from pipeline.adapters.webrtc.peer import MAX_CANDIDATES
from tests.e2e.serve_process import PORT

SLOW_BODIES = 120  # more than the webhook's budget (32) and than one address's share (8)
SILENT_STREAMS = 48  # more than a replica's waiting places for carrier streams (16)


@dataclass
class Target:
    scheme: str  # http or https (the auth server serves TLS only)
    token: str | None = None
    victim_address: str = "127.0.0.140"  # the victim speaks from one of the silent streams' addresses
    probes: list[tuple[float, int | None]] = field(default_factory=list)  # /healthz (seconds, status)

    @property
    def base(self) -> str:
        return f"{self.scheme}://127.0.0.1:{PORT}"

    @property
    def ws_base(self) -> str:
        return f"{'wss' if self.scheme == 'https' else 'ws'}://127.0.0.1:{PORT}"

    @property
    def ssl(self) -> ssl.SSLContext | None:
        return ssl.create_default_context() if self.scheme == "https" else None  # trusts SSL_CERT_FILE

    @property
    def auth(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"} if self.token else {}

    def client(self, address: str = "127.0.0.150") -> httpx.AsyncClient:
        return httpx.AsyncClient(base_url=self.base, transport=httpx.AsyncHTTPTransport(local_address=address),
                                 timeout=30)

    async def metric(self, name: str, labels: str = "") -> float:
        async with self.client() as client:
            text = (await client.get("/metrics", headers=self.auth)).text
        found = re.search(rf"^{re.escape(name)}{re.escape(labels)} (\S+)$", text, flags=re.M)
        return float(found.group(1)) if found else 0.0


async def _status_line(reader: asyncio.StreamReader) -> int:
    return int((await reader.readuntil(b"\r\n")).split(b" ", 2)[1])


async def slow_body(target: Target, path: str, address: str, opened: asyncio.Event | None = None
                    ) -> tuple[int | None, float]:
    """A POST whose body comes a byte every 0.5 s: (the status it got, seconds from its head to it);
    None if nothing answered within 20 s."""
    reader, writer = await asyncio.open_connection("127.0.0.1", PORT, ssl=target.ssl, local_addr=(address, 0),
                                                   server_hostname="127.0.0.1" if target.ssl else None)
    start = time.monotonic()
    try:
        writer.write(f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1:{PORT}\r\nContent-Type: application/x-www-form-"
                     f"urlencoded\r\nContent-Length: 1000\r\n\r\n".encode())
        status = asyncio.ensure_future(_status_line(reader))
        while time.monotonic() - start < 20:
            writer.write(b"x")
            done, _ = await asyncio.wait({status}, timeout=0.5)
            if done:
                return status.result(), time.monotonic() - start
        status.cancel()
        return None, time.monotonic() - start
    except (ConnectionError, asyncio.IncompleteReadError):
        return None, time.monotonic() - start
    finally:
        writer.close()


async def slow_bodies(target: Target) -> list[tuple[int | None, float]]:
    """SLOW_BODIES of them at once, from 40 addresses, half to the phone webhook and half to the
    WebRTC offer (the two routes anyone may reach when auth is off)."""
    paths = ("/v1/phone/twilio/voice", "/v1/realtime/calls")
    return await asyncio.gather(*(slow_body(target, paths[i % 2], f"127.0.0.{100 + i % 40}")
                                  for i in range(SLOW_BODIES)))


async def silent_stream(target: Target, address: str) -> tuple[int | None, str, float]:
    """A carrier stream that says ``connected`` and never starts: (close code or HTTP status of
    its refusal, reason, seconds until then)."""
    start = time.monotonic()
    try:
        async with websockets.connect(f"{target.ws_base}/v1/phone/twilio", local_addr=(address, 0),
                                      ssl=target.ssl, open_timeout=20) as ws:
            await ws.send(json.dumps({"event": "connected", "protocol": "Call", "version": "1.0.0"}))
            try:
                await asyncio.wait_for(ws.recv(), 20)
            except websockets.ConnectionClosed:
                pass
            return ws.close_code, ws.close_reason or "", time.monotonic() - start
    except websockets.InvalidStatus as exc:
        return exc.response.status_code, "", time.monotonic() - start


async def silent_streams(target: Target) -> list[tuple[int | None, str, float]]:
    return await asyncio.gather(*(silent_stream(target, f"127.0.0.{140 + i % 4}") for i in range(SILENT_STREAMS)))


async def offer_sdp(audio: bool = True) -> str:
    """A real client's offer (aiortc: the oai-events channel, and an audio section unless not),
    never answered."""
    pc = RTCPeerConnection()
    if audio:
        pc.addTransceiver("audio")
    pc.createDataChannel("oai-events")
    await pc.setLocalDescription(await pc.createOffer())
    sdp = pc.localDescription.sdp
    await pc.close()
    return sdp


def with_candidates(sdp: str, candidates: list[str]) -> str:
    """``sdp`` with its own candidates replaced by ``candidates``."""
    lines = [line for line in sdp.splitlines() if not line.startswith("a=candidate:")]
    at = next(i for i, line in enumerate(lines) if line.startswith("a=mid:")) + 1
    return "\r\n".join(lines[:at] + [f"a=candidate:{c}" for c in candidates] + lines[at:]) + "\r\n"


async def aimed_offers(target: Target) -> dict[str, tuple[int, dict | str]]:
    """Offers that would aim the server's checks: ~1,100 candidates (65 KB), one over the cap, and
    a handful at private and loopback addresses (taken, but no checks go there)."""
    sdp = await offer_sdp()
    scan = [f"{i} 1 udp 2122260223 10.{i // 250}.{i % 250}.1 {9 + i} typ host" for i in range(1100)]
    out = {}
    async with target.client() as client:
        for name, candidates in (("1,100", scan), ("over the cap", scan[:MAX_CANDIDATES + 1]),
                                 ("private and loopback", scan[:8] + ["90 1 udp 2122260223 127.0.0.1 9 typ host",
                                                                      "91 1 udp 2122260223 192.168.1.1 9 typ host"])):
            r = await client.post("/v1/realtime/calls", content=with_candidates(sdp, candidates),
                                  headers={**target.auth, "Content-Type": "application/sdp"})
            out[name] = (r.status_code, r.json() if r.status_code >= 400 else r.headers.get("location", ""))
            if r.status_code == 201:  # end the call it made
                await client.post(f"{r.headers['location']}/hangup", headers=target.auth)
    return out


async def endless_chunked(target: Target, path: str, content_type: str, limit: int = 16 << 20) -> tuple[int | None, int]:
    """A chunked body of up to ``limit`` bytes, written until the server answers or stops reading:
    (its status, bytes written). A server that answers before the body is read closes with it
    unread, which TCP turns into a reset that may overtake the answer: then the status is None."""
    reader, writer = await asyncio.open_connection("127.0.0.1", PORT, ssl=target.ssl, local_addr=("127.0.0.151", 0),
                                                   server_hostname="127.0.0.1" if target.ssl else None)
    auth = "".join(f"{k}: {v}\r\n" for k, v in target.auth.items())
    writer.write(f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1:{PORT}\r\n{auth}Content-Type: {content_type}\r\n"
                 "Transfer-Encoding: chunked\r\n\r\n".encode())
    status = asyncio.ensure_future(_status_line(reader))
    sent, chunk = 0, b"%x\r\n%s\r\n" % (64 * 1024, b"a" * 64 * 1024)
    try:
        while sent < limit and not status.done():
            writer.write(chunk)
            await asyncio.wait_for(writer.drain(), 10)
            sent += 64 * 1024
    except (ConnectionError, TimeoutError):
        pass  # the server stopped reading and closed: its answer may be in already
    try:
        return await asyncio.wait_for(status, 10), sent
    except (ConnectionError, asyncio.IncompleteReadError, TimeoutError):
        return None, sent
    finally:
        writer.close()


async def big_bodies(target: Target) -> dict[str, tuple[int | None, int]]:
    return {"offer": await endless_chunked(target, "/v1/realtime/calls", "multipart/form-data; boundary=x"),
            "client secret": await endless_chunked(target, "/v1/realtime/client_secrets", "application/json",
                                                   limit=8 << 20)}


BAD_SESSIONS = {  # nested objects where strings (or other types) belong, and values refused
    "instructions an object": {"type": "realtime", "instructions": {"text": {"a": 1}}},
    "format type an object": {"audio": {"input": {"format": {"type": {"x": "audio/pcm"}}}}},
    "eagerness a list": {"audio": {"input": {"turn_detection": {"type": "semantic_vad", "eagerness": ["low"]}}}},
    "audio a string": {"audio": "loud"},
    "an unknown voice": {"audio": {"output": {"voice": "nobody"}}},
    "nested 500 deep": {"prompt": json.loads("[" * 500 + "]" * 500)},  # ~1 KB; deepcopy of it recursed out
}


async def bad_sessions(target: Target) -> dict[str, tuple[int, dict, int, dict]]:
    """Each bad session in a multipart offer and in a client secret request: (offer status, its
    body, client secret status, its body)."""
    sdp = await offer_sdp()
    out = {}
    async with target.client() as client:
        for name, session in BAD_SESSIONS.items():
            offer = await client.post("/v1/realtime/calls", headers=target.auth,
                                      files={"sdp": (None, sdp), "session": (None, json.dumps(session))})
            secret = await client.post("/v1/realtime/client_secrets", json={"session": session},
                                       headers=target.auth)
            out[name] = (offer.status_code, offer.json(), secret.status_code, secret.json())
    return out


async def bad_telnyx_starts(target: Target) -> dict[str, tuple[int | None, str]]:
    """Telnyx starts with a list where a string belongs: (close code, reason)."""
    start = {"event": "start", "stream_id": "s1", "start": {"call_control_id": "c1", "media_format": {
        "encoding": "PCMU", "sample_rate": 8000, "channels": 1}, "custom_parameters": [{"name": "a", "value": "b"}]}}
    variants = {"encoding a list": ("media_format", {"encoding": ["PCMU"], "sample_rate": 8000, "channels": 1}),
                "a parameter's name a list": ("custom_parameters", [{"name": ["a"], "value": "b"}])}
    out = {}
    for name, (key, value) in variants.items():
        msg = json.loads(json.dumps(start))
        msg["start"][key] = value
        async with websockets.connect(f"{target.ws_base}/v1/phone/telnyx", ssl=target.ssl,
                                      local_addr=("127.0.0.152", 0)) as ws:
            await ws.send(json.dumps(msg))
            try:
                await asyncio.wait_for(ws.recv(), 20)
            except websockets.ConnectionClosed:
                pass
            out[name] = (ws.close_code, ws.close_reason or "")
    return out


async def probe_health(target: Target, stop: asyncio.Event) -> None:
    """/healthz every 0.5 s until ``stop``: how long each took and what it answered."""
    async with target.client("127.0.0.153") as client:
        while not stop.is_set():
            start = time.monotonic()
            try:
                status = (await client.get("/healthz", timeout=10)).status_code
            except httpx.HTTPError:
                status = None
            target.probes.append((time.monotonic() - start, status))
            try:
                await asyncio.wait_for(stop.wait(), 0.5)
            except TimeoutError:
                pass


async def victim(target: Target, attacks: asyncio.Future) -> list[float]:
    """A v1 conversation of typed turns, its handshake made mid-attack, taking turns for as long as
    the ``attacks`` run (two at least): every gap between its audio chunks."""
    gaps: list[float] = []
    url = f"{target.ws_base}/v1/conversation?turn_detection=manual"
    async with Conversation(url, token=target.token, local_addr=(target.victim_address, 0)) as conv:
        while len(conv.turns) < 2 or not attacks.done():
            turn = await conv.say_text(("Tell me about the sea.", "And the mountains?")[len(conv.turns) % 2])
            assert turn.chunks and not turn.interrupted
            gaps += turn.gaps
    return gaps


async def beside_victim(target: Target, phases: list[dict]) -> tuple[dict, list[float]]:
    """Run each phase's attacks (name -> coroutine) at once, one phase after another, with a victim
    conversation that begins 1 s into the first phase and /healthz probed throughout. Attacks on the
    same anonymous route go in different phases: such a route's budget is shared by all its
    anonymous callers, which is what bounds them."""
    stop = asyncio.Event()
    probe = asyncio.ensure_future(probe_health(target, stop))

    async def attack() -> dict:
        results: dict = {}
        for phase in phases:
            results.update(zip(phase, await asyncio.gather(*phase.values())))
        return results

    attacks = asyncio.ensure_future(attack())
    try:
        await asyncio.sleep(1.0)  # not synchronisation: the victim is meant to arrive mid-attack
        gaps = await victim(target, attacks)
        results = await attacks
    finally:
        stop.set()
        await probe
        attacks.cancel()
    return results, gaps


def assert_slow_bodies_held(results: list[tuple[int | None, float]]) -> None:
    """Each slow body was answered: 408 at the body deadline, or 503 at once (its route's budget
    or its address's share spent); none was held past the deadline."""
    statuses = [status for status, _ in results]
    assert set(statuses) <= {408, 503}, statuses
    assert statuses.count(408) >= 8, statuses  # up to the budget, they were read until the deadline
    late = [s for status, s in results if status == 408 and not bodies.BODY_TIMEOUT_S - 1 <= s <= bodies.BODY_TIMEOUT_S + 3]
    assert not late, late


def assert_silent_streams_held(results: list[tuple[int | None, str, float]], waiting: int = 16) -> None:
    """The silent carrier streams waited apart: at most ``waiting`` at once, each closed 1008 at
    the start deadline; the rest refused 503 at the handshake."""
    codes = [code for code, _, _ in results]
    assert set(codes) <= {1008, 503}, codes
    assert 0 < codes.count(1008) and codes.count(503) >= len(results) - 2 * waiting, codes
    for code, reason, seconds in results:
        if code == 1008:
            assert reason == "no start within 5 s" and 4 <= seconds <= 9, (reason, seconds)
