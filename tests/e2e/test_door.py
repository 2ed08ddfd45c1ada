"""One client cannot stall a replica: every input of /v1/realtime bounded as v1's are, against the
real app (`serve run serve_config.yaml`, plain: the proxy's limits come from the environment's
.pth, not from a wrapper script). Where an attack could hurt others, a victim conversation speaks
beside the attacker, and its audio must keep flowing with no gap over 500 ms."""
from __future__ import annotations

import asyncio
import base64
import json
import re
import socket
import time
from pathlib import Path

import numpy as np
import pytest
import websockets

from load.client import Conversation
from pipeline.adapters.v1 import protocol as P
from pipeline.conversation.agent import MAX_SCHEMA_DEPTH, MAX_TOOLS_CHARS
from pipeline.conversation.history import MAX_ITEM_CHARS
from pipeline.adapters.realtime.session_object import MAX_SESSION_CHARS
from tests.e2e.serve_process import PORT, REALTIME_URL, URL

pytestmark = pytest.mark.timeout(600)
MAX_GAP_S = 0.5


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 300))


class Realtime:
    """A raw Realtime client (JSON text frames), for events no SDK would send."""

    def __init__(self, ws):
        self.ws = ws

    async def send(self, event: dict | str) -> None:
        await self.ws.send(event if isinstance(event, str) else json.dumps(event))

    async def next(self, *types: str, timeout: float = 60) -> dict:
        """The next event of one of ``types`` (others are skipped)."""
        deadline = time.monotonic() + timeout
        while True:
            event = json.loads(await asyncio.wait_for(self.ws.recv(), max(0.1, deadline - time.monotonic())))
            if event["type"] in types:
                return event

    async def error_for(self, event: dict, timeout: float = 60) -> dict:
        """Send ``event`` (with an event_id) and return the error event naming it."""
        eid = event.setdefault("event_id", f"evt_{time.monotonic_ns()}")
        await self.send(event)
        while True:
            got = await self.next("error", timeout=timeout)
            if got["error"].get("event_id") == eid:
                return got["error"]


async def realtime() -> tuple[websockets.ClientConnection, Realtime]:
    ws = await websockets.connect(REALTIME_URL, max_size=None)
    rt = Realtime(ws)
    await rt.next("session.created")
    await rt.send({"type": "session.update", "session": {"type": "realtime", "audio": {"input": {"turn_detection": None}}}})
    await rt.next("session.updated")
    return ws, rt


async def victim(turns: int = 2) -> list[float]:
    """A v1 conversation of typed turns beside an attack: every gap between its audio chunks."""
    gaps = []
    async with Conversation(URL) as conv:
        for i in range(turns):
            tr = await conv.say_text(["Tell me about the sea.", "And the mountains?"][i % 2])
            assert tr.chunks and not tr.interrupted
            gaps += tr.gaps
    return gaps


async def beside(attack) -> tuple[object, list[float]]:
    """Run ``attack`` (a coroutine) and a victim conversation at once: (attack's result, victim's gaps)."""
    result, gaps = await asyncio.gather(attack, victim())
    return result, gaps


# ----------------------------------------------------------------------------- 1. session.update
def test_session_updates_keep_no_unknown_keys_and_stay_bounded(server):
    """Unknown session keys are dropped, not kept and echoed; an event over 64 KiB (not an audio
    event) is refused whole; a session object past MAX_SESSION_CHARS is refused; 200 updates of
    junk beside a victim leave the session object small and the victim's audio flowing."""
    async def attack():
        ws, rt = await realtime()
        async with ws:
            junk = {"type": "realtime", "x_" + "k" * 10: "v" * 30_000}
            for i in range(200):
                await rt.send({"type": "session.update", "session": {**junk, f"extra_{i}": i}})
            updated = None
            for _ in range(200):
                updated = await rt.next("session.updated", "error")
            big = await rt.error_for({"type": "conversation.item.delete", "item_id": "x" * (70 * 1024)})
            await rt.send({"type": "session.update", "session": {"prompt": {"p": "v" * 40_000}}})
            kept = await rt.next("session.updated")  # 40,000 characters: within the cap
            over = await rt.error_for({"type": "session.update", "session": {"tracing": {"t": "w" * 40_000}}})
            return updated, big, kept, over

    (updated, big, kept, over), gaps = run(beside(attack()))
    assert updated["type"] == "session.updated"
    session = updated["session"]
    assert not [k for k in session if k.startswith(("x_", "extra_"))]  # dropped, not echoed
    assert len(json.dumps(session)) < 4096
    assert (big["code"], big["type"]) == ("event_too_large", "invalid_request_error")
    assert kept["session"]["prompt"] == {"p": "v" * 40_000}
    assert (over["code"], over["param"]) == ("invalid_value", "session") and str(MAX_SESSION_CHARS) in over["message"]
    assert max(gaps) <= MAX_GAP_S, max(gaps)


# ----------------------------------------------------------------------------- 2. the history
def test_every_item_is_capped_and_counts_against_the_history(server):
    """An item over MAX_ITEM_CHARS is refused; assistant items added with no user message (which
    escaped the history's bound before) push the oldest out once the history is over its limit."""
    async def go():
        ws, rt = await realtime()
        async with ws:
            too_big = await rt.error_for({"type": "conversation.item.create", "item": {
                "type": "message", "role": "assistant",
                "content": [{"type": "output_text", "text": "a" * (MAX_ITEM_CHARS + 1)}]}})
            ids = []
            for i in range(10):  # 10 x 15,000 characters: over max_history_chars (64,000)
                await rt.send({"type": "conversation.item.create", "item": {
                    "id": f"item_flood_{i}", "type": "message", "role": "assistant",
                    "content": [{"type": "output_text", "text": f"{i} " + "b" * 15_000}]}})
                ids.append((await rt.next("conversation.item.done"))["item"]["id"])
            first = await rt.error_for({"type": "conversation.item.retrieve", "item_id": ids[0]})
            await rt.send({"type": "conversation.item.retrieve", "item_id": ids[-1]})
            last = await rt.next("conversation.item.retrieved")
            return too_big, first, last, ids

    too_big, first, last, ids = run(go())
    assert (too_big["code"], too_big["param"]) == ("item_too_large", "item")
    assert first["code"] == "item_not_found"  # the oldest went
    assert last["item"]["id"] == ids[-1]


# ----------------------------------------------------------------------------- 3. item audio
def test_item_audio_pays_the_audio_allowance(server):
    """Items of input_audio pay from the same allowance as streamed audio (60 s at once, then 2x
    real time): four 20 s items back to back, the fourth is refused with audio_too_fast; a victim
    conversation meanwhile is unharmed."""
    pcmu = base64.b64encode(np.full(20 * 8000, 0xFF, np.uint8).tobytes()).decode()  # 20 s of μ-law silence

    async def attack():
        ws, rt = await realtime()
        async with ws:
            await rt.send({"type": "session.update", "session": {"audio": {"input": {"format": {"type": "audio/pcmu"}}}}})
            await rt.next("session.updated")
            answers = []
            for i in range(4):
                await rt.send({"type": "conversation.item.create", "event_id": f"audio_{i}", "item": {
                    "type": "message", "role": "user", "content": [{"type": "input_audio", "audio": pcmu}]}})
                got = await rt.next("conversation.item.done", "error", timeout=120)
                answers.append(got["type"] if got["type"] != "error" else got["error"]["code"])
            return answers

    answers, gaps = run(beside(attack()))
    assert answers == ["conversation.item.done"] * 3 + ["audio_too_fast"]
    assert max(gaps) <= MAX_GAP_S, max(gaps)


# ----------------------------------------------------------------------------- 4. tools and the reply rate
def test_tools_are_capped_and_replies_asked_for_are_rate_limited(server):
    """Tools over MAX_TOOLS_CHARS, or nested past MAX_SCHEMA_DEPTH (100 levels raised RecursionError:
    1011 before), are refused with invalid_value; response.create past the reply allowance (10 at
    once) gets rate_limited; the session goes on."""
    def nested(depth: int) -> dict:
        schema: dict = {"type": "string"}
        for _ in range(depth):
            schema = {"type": "object", "properties": {"a": schema}}
        return schema

    async def go():
        ws, rt = await realtime()
        async with ws:
            many = [{"type": "function", "name": f"tool_{i}", "description": "d" * 900,
                     "parameters": {"type": "object"}} for i in range(40)]
            large = await rt.error_for({"type": "session.update", "session": {"tools": many}})
            deep = await rt.error_for({"type": "session.update", "session": {"tools": [
                {"type": "function", "name": "deep", "parameters": nested(100)}]}})
            for i in range(14):  # each started and cancelled at once: 14 asked for within a second
                await rt.send({"type": "response.create", "event_id": f"r{i}",
                               "response": {"output_modalities": ["text"]}})
                await rt.send({"type": "response.cancel"})
            codes = []
            while len(codes) < 14:
                got = await rt.next("response.created", "error")
                if got["type"] == "response.created":
                    codes.append("created")
                elif (got["error"].get("event_id") or "").startswith("r"):
                    codes.append(got["error"]["code"])
            await rt.send({"type": "conversation.item.create", "item": {"type": "message", "role": "user",
                                                                          "content": [{"type": "input_text", "text": "hi"}]}})
            alive = await rt.next("conversation.item.done")
            return large, deep, codes, alive

    large, deep, codes, alive = run(go())
    assert (large["code"], large["param"]) == ("invalid_value", "session.tools") and str(MAX_TOOLS_CHARS) in large["message"]
    assert (deep["code"], deep["param"]) == ("invalid_value", "session.tools") and str(MAX_SCHEMA_DEPTH) in deep["message"]
    assert codes[:10] == ["created"] * 10 and codes.count("rate_limited") >= 2, codes
    assert alive["item"]["role"] == "user"


def test_typed_turns_over_the_reply_rate_are_refused_on_v1(server):
    async def go():
        async with websockets.connect(URL, max_size=None) as ws:
            await ws.recv()  # session.ready
            for i in range(12):
                await ws.send(P.pack({"type": "text", "text": f"Hello {i}"}))
            codes = []
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline and "rate_limited" not in codes:
                msg = P.unpack(await asyncio.wait_for(ws.recv(), 60))
                if msg["type"] == "error":
                    codes.append(msg["code"])
            return codes

    assert "rate_limited" in run(go())


# ----------------------------------------------------------------------------- 6. resume
def test_resuming_a_live_session_closes_the_older_connection(server):
    """A v1 session resumed while its first connection is still open: the newer connection wins,
    the older gets session_replaced and close 4001 (before, both went on as one session id)."""
    async def go():
        old = await websockets.connect(URL, max_size=None)
        ready = P.unpack(await old.recv())
        await old.send(P.pack({"type": "text", "text": "Hello there."}))
        while P.unpack(await asyncio.wait_for(old.recv(), 60))["type"] != "response.done":
            pass  # a turn: the conversation has been saved since
        new = await websockets.connect(f"{URL}&resume={ready['resume_token']}", max_size=None)
        resumed = P.unpack(await new.recv())
        told = None
        with pytest.raises(websockets.ConnectionClosed) as closed:
            while True:
                msg = P.unpack(await asyncio.wait_for(old.recv(), 30))
                if msg["type"] == "error":
                    told = msg
        await new.send(P.pack({"type": "text", "text": "Still me?"}))
        kinds = []
        while "response.done" not in kinds:
            kinds.append(P.unpack(await asyncio.wait_for(new.recv(), 60))["type"])
        await new.close()
        return ready, resumed, told, closed.value.rcvd, kinds

    ready, resumed, told, rcvd, kinds = run(go())
    assert resumed["type"] == "session.ready" and resumed.get("resumed") and resumed["session_id"] == ready["session_id"]
    assert told["code"] == P.E_SESSION_REPLACED
    assert rcvd.code == P.CLOSE_SESSION_REPLACED and "resumed" in rcvd.reason
    assert "audio" in kinds


# ----------------------------------------------------------------------------- 7. bad input
def test_bad_input_is_an_error_not_an_internal_failure(server):
    """Deeply nested JSON, odd-length pcm16 in an item and in a voice clip: each one error event
    (1011 and voice_errors{code="internal"} before), and the session goes on."""
    odd = base64.b64encode(b"\x01\x02\x03").decode()

    async def go():
        ws, rt = await realtime()
        async with ws:
            await rt.send('{"type": "session.update", "event_id": "deep", "session": ' + "[" * 5000 + "]" * 5000 + "}")
            deep = await rt.next("error")
            item = await rt.error_for({"type": "conversation.item.create", "item": {
                "type": "message", "role": "user", "content": [{"type": "input_audio", "audio": odd}]}})
            clip = await rt.error_for({"type": "session.update", "session": {"audio": {"output": {
                "voice_clip": {"audio": odd, "transcript": "Hello."}}}}})
            await rt.send({"type": "conversation.item.create", "item": {"type": "message", "role": "user",
                                                                          "content": [{"type": "input_text", "text": "ok"}]}})
            alive = await rt.next("conversation.item.done")
            return deep["error"], item, clip, alive

    deep, item, clip, alive = run(go())
    assert deep["code"] == "invalid_json" and "deeply" in deep["message"]
    assert (item["code"], item["param"]) == ("invalid_value", "item.content.audio")
    assert clip["code"] == "invalid_value" and "even number of bytes" in clip["message"]
    assert alive["item"]["content"][0]["text"] == "ok"


# ----------------------------------------------------------------------------- 8. /healthz
def test_healthz_answers_from_a_cached_check(server):
    """100 /healthz calls at once cost the model replicas one or two ready calls each (a check at
    most once a second), not 100: counted in the STT replica's request log."""
    log = Path(server.log_path)

    def ready_calls() -> int:
        return len(re.findall(r"gapless_STT .* -- CALL ready", log.read_text(errors="replace")))

    import urllib.request

    def get() -> int:
        with urllib.request.urlopen(f"http://127.0.0.1:{PORT}/healthz", timeout=30) as r:
            return r.status

    async def go():
        before = ready_calls()
        t0 = time.monotonic()
        statuses = await asyncio.gather(*[asyncio.to_thread(get) for _ in range(100)])
        took = time.monotonic() - t0
        deadline = time.monotonic() + 10  # the replica's log reaches the driver's within a moment
        while time.monotonic() < deadline and ready_calls() == before:
            await asyncio.sleep(0.2)
        return statuses, ready_calls() - before, took

    statuses, calls, took = run(go())
    assert statuses == [200] * 100
    assert 1 <= calls <= int(took) + 2, (calls, took)


# ----------------------------------------------------------------------------- 9 and 11. the proxy
def test_plain_serve_run_has_the_door_limits_and_drops_half_sent_handshakes(server):
    """The app was started with plain `serve run` (no wrapper, the variable not in its environment:
    tests/e2e/serve_process.py): a 1 MiB message still closes with 1009, no permessage-deflate is
    offered, and 100 connections that send half an upgrade are closed by the proxy within its
    handshake timeout, while a victim conversation goes on."""
    from deployments.proxy_limits import HANDSHAKE_TIMEOUT_S

    async def half_sent() -> list[float]:
        socks = []
        for _ in range(100):
            s = socket.create_connection(("127.0.0.1", PORT))
            s.sendall(b"GET /v1/conversation HTTP/1.1\r\nHost: 127.0.0.1\r\nUpgrade: websocket\r\n")
            s.setblocking(False)
            socks.append(s)
        t0, closed_after = time.monotonic(), {}
        while len(closed_after) < len(socks) and time.monotonic() - t0 < HANDSHAKE_TIMEOUT_S + 20:
            for i, s in enumerate(socks):
                if i in closed_after:
                    continue
                try:
                    if s.recv(1024) == b"":
                        closed_after[i] = time.monotonic() - t0
                except BlockingIOError:
                    pass
                except OSError:
                    closed_after[i] = time.monotonic() - t0
            await asyncio.sleep(0.2)
        for s in socks:
            s.close()
        return sorted(closed_after.values())

    async def big_message():
        async with websockets.connect(URL, max_size=None, compression="deflate") as ws:
            deflate = ws.response.headers.get("Sec-WebSocket-Extensions")
            await ws.recv()
            try:
                await ws.send(b"\x00" * (1 << 20))
            except websockets.ConnectionClosed as exc:  # the proxy's 1009 came while it was still written
                return deflate, exc.rcvd
            except ConnectionError:  # the proxy closed (1009) while the message was still being written
                pass
            with pytest.raises(websockets.ConnectionClosed) as closed:
                while True:
                    await ws.recv()
            return deflate, closed.value.rcvd

    async def go():
        (closed, gaps), (deflate, rcvd) = await asyncio.gather(beside(half_sent()), big_message())
        return closed, gaps, deflate, rcvd

    closed, gaps, deflate, rcvd = run(go())
    assert len(closed) == 100 and closed[-1] <= HANDSHAKE_TIMEOUT_S + 5, closed[-5:]
    assert deflate is None
    assert rcvd is not None and rcvd.code == 1009
    assert max(gaps) <= MAX_GAP_S, max(gaps)


# ----------------------------------------------------------------------------- the phone and WebRTC doors
def test_the_phone_and_webrtc_doors_hold_against_anonymous_attacks_beside_a_victim(server):
    """Auth off (serve_config.yaml as it ships), so the offer itself is anonymous: slow bodies on
    the phone webhook, carrier streams that never start, offers that would aim the server's ICE
    checks, endless bodies, sessions of the wrong types and Telnyx starts of the wrong types, all
    at once beside a v1 conversation (tests/door_attacks.py). Each door holds, /healthz answers
    throughout, nothing becomes an internal error, and the victim's audio never pauses 500 ms."""
    from tests import door_attacks as A

    target = A.Target("http")
    results, gaps, before, after = run(_doors(A, target))
    _assert_doors_held(A, target, results, gaps, before, after)


async def _doors(A, target):
    counters = [("voice_errors_total", '{code="internal"}'), ("voice_webrtc_candidates_dropped_total",
                                                              '{reason="not_public"}')]
    before = [await target.metric(*c) for c in counters]
    results, gaps = await A.beside_victim(target, [
        {"slow": A.slow_bodies(target), "silent": A.silent_streams(target)},
        {"aimed": A.aimed_offers(target), "big": A.big_bodies(target), "sessions": A.bad_sessions(target),
         "telnyx": A.bad_telnyx_starts(target)}])
    after = [await target.metric(*c) for c in counters]
    return results, gaps, before, after


def _assert_doors_held(A, target, results, gaps, before, after) -> None:
    """What tests/e2e_auth/test_door_phone_webrtc.py asserts too, with auth on."""
    A.assert_slow_bodies_held(results["slow"])
    A.assert_silent_streams_held(results["silent"])
    aimed = results["aimed"]
    assert aimed["1,100"][0] == 413 and aimed["1,100"][1]["error"]["code"] in ("invalid_sdp", "body_too_large")
    assert (aimed["over the cap"][0], aimed["over the cap"][1]["error"]["code"]) == (400, "too_many_candidates")
    assert aimed["private and loopback"][0] == 201
    assert after[1] - before[1] == 10  # its ten candidates were dropped: no check went to them
    for name, (status, sent) in results["big"].items():  # None: the server reset the connection before its
        assert status in (413, None) and sent < (8 << 20), (name, status, sent)  # 413 was read (unread body)
    for name, (offer, offer_body, secret, secret_body) in results["sessions"].items():
        for status, body in ((offer, offer_body), (secret, secret_body)):
            assert status == 400 and body["error"]["type"] == "invalid_request_error", (name, status, body)
            assert body["error"]["param"].startswith("session"), (name, body)
    for name, (code, reason) in results["telnyx"].items():
        assert code == 1008 and ("encoding" in reason or "custom_parameters" in reason), (name, code, reason)
    assert after[0] == before[0]  # no internal error
    assert target.probes and all(status == 200 and seconds < 2 for seconds, status in target.probes), target.probes
    assert max(gaps) <= MAX_GAP_S, max(gaps)
