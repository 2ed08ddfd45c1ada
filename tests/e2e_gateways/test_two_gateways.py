"""The app with two Gateway replicas and auth on: what holds across replicas.

- A ticket opens one connection across gateway replicas (deployments/tickets.py): each ticket is
  used twice; Ray's proxy spreads handshakes over both replicas, so with per-replica records about
  half of the second uses would get in.
- A dropped connection resumes on the other replica (deployments/session_store.py).
- A redeploy that replaces both gateway replicas (`serve deploy` of a changed config) under three
  conversations: each drained session resumes on another replica, none is lost, and every later
  turn is answered in full. It runs last: it leaves the app redeployed.
"""
from __future__ import annotations

import asyncio
import json
import os
import secrets
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import websockets
import yaml

from load import browser
from load.client import Conversation
from pipeline.adapters.v1 import protocol as P
from tests.e2e.serve_process import PORT, ROOT, URL, ServeProcess

TICKETS = 8
REPLICA = "x-gapless-replica"


def _config(num_cpus_share: float = 2) -> dict:
    cfg = yaml.safe_load((ROOT / "serve_config.yaml").read_text())
    app = cfg["applications"][0]
    app["args"]["auth"] = {"mode": "token", "tokens_env": "GAPLESS_TOKENS"}
    # The redeploy test's conversations ask for typed replies back to back for a minute (the tiny
    # LLM's replies are short): over the default 60 a minute, which this file does not test.
    app["args"].setdefault("session", {})["max_replies_per_minute"] = 600
    for d in app["deployments"]:
        if d["name"] == "Gateway":  # two replicas in the CPU share of one (2 cores in all)
            d["num_replicas"] = 2
            d["ray_actor_options"]["num_cpus"] = d["ray_actor_options"]["num_cpus"] / num_cpus_share
    return cfg


def _write(cfg: dict, name: str) -> Path:
    path = ROOT / "out" / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


@pytest.fixture(scope="module")
def two_gateways():
    path = _write(_config(), "serve_config.two_gateways.yaml")
    token = secrets.token_urlsafe(32)
    proc = ServeProcess(str(path), log_path=str(ROOT / "out" / "serve-two-gateways.log"),
                        env={"GAPLESS_TOKENS": token})
    proc.start()
    proc.token = token
    yield proc
    proc.stop()


async def _use(ticket: str, then=None) -> tuple[int, dict]:
    """(101, session.ready) or (HTTP status, body); ``then()`` is awaited while the session is open."""
    url = f"ws://127.0.0.1:{PORT}/v1/conversation?ticket={ticket}&turn_detection=manual"
    try:
        async with websockets.connect(url) as ws:
            ready = P.unpack(await asyncio.wait_for(ws.recv(), 30))
            return 101, ready, (await then() if then else None)
    except websockets.InvalidStatus as exc:
        return exc.response.status_code, json.loads(bytes(exc.response.body)), None


def test_a_ticket_opens_one_connection_across_gateway_replicas(two_gateways):
    headers = {"Authorization": f"Bearer {two_gateways.token}"}
    tickets = [httpx.post(f"http://127.0.0.1:{PORT}/v1/session", headers=headers, timeout=30).json()["ticket"]
               for _ in range(TICKETS)]

    async def go():
        # The second use comes while the first session is still open: Ray's router then prefers the
        # other, idle gateway replica, which never saw the ticket.
        return [await _use(t, then=lambda t=t: _use(t)) for t in tickets]

    uses = asyncio.run(go())
    assert [status for status, _, _ in uses] == [101] * TICKETS
    assert [(again[0], again[1].get("code")) for _, _, again in uses] == [(401, "unauthorized")] * TICKETS


def _replica(c: Conversation) -> str:
    return c.ws.response.headers[REPLICA]


def test_a_dropped_connection_resumes_on_the_other_gateway_replica(two_gateways):
    """The link drops mid-reply (no close frame); the client resumes by itself. The resumed session
    has the same id, its cut turn's number, and answers the next turn, numbered after it, in full,
    on the other gateway replica.

    Ray's proxy sends a connection to the replica with fewer open requests (a tie: either). So two
    other sessions are held open on the dropped session's replica and none on the other, which
    then has fewer whether or not the proxy has yet seen the dropped one end. (With one session
    each, a tie, CI's resume went back to the same replica.) Should it still land there, the idle
    session is dropped again, up to three times in all: each resume must keep the session whole."""
    async def go():
        async with Conversation(URL, token=two_gateways.token, resume=True) as c:
            await c.say_text("Hello there.")
            home = _replica(c)
            here, there_ = [], []
            while len(here) < 2 and len(here) + len(there_) < 12:
                o = Conversation(URL, token=two_gateways.token)
                await o.__aenter__()
                (here if _replica(o) == home else there_).append(o)
            for o in there_:
                await o.__aexit__()
            cut = await c.send_text_turn("Tell me a long story about the sea.")
            await c.wait_for(lambda m: m["type"] == "audio" and m["turn"] == cut)
            before = dict(c.ready)
            backs = []
            while True:
                c.drop()
                backs.append(await c.wait_for(lambda m: m["type"] == "<resumed>", timeout=30))
                if _replica(c) != home or len(backs) == 3:
                    break
            after = await c.say_text("And then what happened?")
            for o in here:
                await o.__aexit__()
            return before, backs, home, _replica(c), cut, after, c, len(here)

    before, backs, home, there, cut, after, c, held = asyncio.run(go())
    print(json.dumps({"drops_until_the_other_replica": len(backs), "sessions_held_on_home": held}))
    assert held == 2
    for back in backs:
        assert back["resumed"] is True and back["session_id"] == before["session_id"] and back["turn"] == cut
    assert there != home, "the resumed session is on the other gateway replica"
    assert [r.close_code for r in c.resumes] == [1006] * len(backs) and all(r.after_s < 2.0 for r in c.resumes)
    assert c.turns[cut].interrupted is True and not c.turns[cut].lost
    assert after.turn == cut + 1 and after.final_text == "And then what happened?"
    assert after.interrupted is False and after.chunks and after.response_text
    assert c.errors == []


def _deploy(path: Path) -> None:
    """``serve deploy`` onto the running cluster (the CLI needs Ray's token auth for it)."""
    serve = str(Path(sys.executable).parent / "serve")
    subprocess.run([serve, "deploy", str(path), "-a", "http://127.0.0.1:8265"], check=True, cwd=ROOT, timeout=60,
                   env=dict(os.environ, RAY_AUTH_MODE="token"))


def test_a_redeploy_of_the_gateways_keeps_every_conversation(two_gateways):
    """Both gateway replicas replaced while three conversations talk (a changed gateway config,
    as `serve deploy` of a new version does): each session on a stopping replica gets its reply's
    response.done, going_away and close 1012, and resumes on another replica within 2 s; none is
    lost, and every turn after the redeploy is answered in full. The web page, connected beside
    them (in Chromium), resumes by itself too and answers its next turn. Runs last: the app stays
    redeployed."""
    changed = _config(num_cpus_share=2.5)  # another CPU share: Serve replaces the replicas
    with browser.Page(f"http://127.0.0.1:{PORT}/?mode=manual&transport=websocket") as page:  # push-to-talk: the microphone stays unsent
        page.connect()  # asks for the token
        page.connect(token=two_gateways.token)
        assert page.state()["status"].startswith("connected"), page.state()["errors"]
        told = len(page.state()["errors"])  # "this server needs a token", from the first connect
        with ThreadPoolExecutor(1) as pool:  # Playwright's sync API holds this thread's event loop
            convs, later, took = pool.submit(asyncio.run, _talk_through_a_redeploy(two_gateways.token, changed)).result()
        page.wait("g.resumed >= 1 && g.status.startsWith('connected')", timeout_s=30)
        page.type_turn("Are you still there?")
        typed = page.wait_turn_done(1, timeout_s=60)
        seen = page.state()
    print(json.dumps({"redeploy_s": round(took, 1), "page_drops": seen["drops"], "resumes": [
        [{"code": r.close_code, "after_s": round(r.after_s, 3), "attempts": r.attempts} for r in c.resumes]
        for c in convs]}))
    assert seen["drops"] and all(d["code"] == P.CLOSE_SERVICE_RESTART for d in seen["drops"])
    assert typed["interrupted"] is False and typed["chunks"] > 0 and seen["errors"][told:] == [], seen["errors"]
    for c in convs:
        assert c.errors == [], c.errors
        assert c.resumes and all(r.resumed_at is not None and r.close_code == P.CLOSE_SERVICE_RESTART
                                 for r in c.resumes)
        assert all(r.after_s < 2.0 for r in c.resumes)
        assert not any(tr.lost for tr in c.turns.values())
        assert sorted(c.turns) == list(range(1, len(c.turns) + 1))  # no turn number reused or skipped
    for tr in later:
        assert tr.interrupted is False and tr.chunks and tr.response_text


async def _talk_through_a_redeploy(token: str, changed: dict):
    """Three conversations talk while `serve deploy` replaces the gateway replicas, until each is
    on a new one; then each says one more turn."""
    async def talk(c: Conversation, stop: asyncio.Event) -> None:
        while not stop.is_set():
            await c.say_text("Tell me about the weather today.")

    old = await _replicas(token)
    convs = [Conversation(URL, token=token, resume=True) for _ in range(3)]
    for c in convs:
        await c.__aenter__()
    stop = asyncio.Event()
    talking = [asyncio.create_task(talk(c, stop)) for c in convs]
    await asyncio.sleep(1.0)  # replies in flight
    t0 = time.monotonic()
    await asyncio.to_thread(_deploy, _write(changed, "serve_config.two_gateways.redeploy.yaml"))
    while not all(c.resumes and c.resumes[-1].resumed_at and _replica(c) not in old for c in convs):
        if time.monotonic() - t0 > 120:
            raise TimeoutError(f"not every session moved to a new replica: {[c.resumes for c in convs]}")
        await asyncio.sleep(0.2)
    stop.set()
    await asyncio.gather(*talking)
    later = [await c.say_text("And tomorrow?") for c in convs]
    for c in convs:
        await c.__aexit__()
    return convs, later, time.monotonic() - t0


async def _replicas(token: str) -> set[str]:
    """The gateway replicas serving now (both: connections are opened until two answer)."""
    seen, held = set(), []
    while len(seen) < 2 and len(held) < 16:
        c = Conversation(URL, token=token)
        await c.__aenter__()
        held.append(c)
        seen.add(_replica(c))
    for c in held:
        await c.__aexit__()
    assert len(seen) == 2, seen
    return seen


def _serve_status() -> dict:
    serve = str(Path(sys.executable).parent / "serve")
    out = subprocess.run([serve, "status", "-a", "http://127.0.0.1:8265"], check=True, capture_output=True, text=True,
                         cwd=ROOT, timeout=60, env=dict(os.environ, RAY_AUTH_MODE="token")).stdout
    return yaml.safe_load(out)["applications"]["gapless"]["deployments"]


def _running(deployment: str) -> int:
    return _serve_status().get(deployment, {}).get("replica_states", {}).get("RUNNING", 0)


def test_the_tts_scales_out_when_its_slots_fill(two_gateways):
    """The TTS on SlotPolicy (deployments/autoscaling.py) with 2 slots and room for 2 replicas:
    three conversations talking fill the slots, and a second TTS replica starts and serves.
    After the redeploy test: the gateways stay as it left them."""
    cfg = _config(num_cpus_share=2.5)
    app = cfg["applications"][0]
    app["args"]["tts"]["num_slots"] = 2
    for d in app["deployments"]:
        if d["name"] == "TTS":  # two replicas in the CPU share of one
            d["ray_actor_options"]["num_cpus"] = d["ray_actor_options"]["num_cpus"] / 2
            d["autoscaling_config"] = {
                "min_replicas": 1, "max_replicas": 2, "upscale_delay_s": 0, "downscale_delay_s": 0,
                "look_back_period_s": 6, "metrics_interval_s": 2,
                "policy": {"policy_function": "deployments.autoscaling:SlotPolicy",
                           "policy_kwargs": {"scale_up_at": 0.75, "scale_down_below": 0.35,
                                             "scale_down_after_s": 600}}}
    _deploy(_write(cfg, "serve_config.two_gateways.autoscaling.yaml"))
    deadline = time.monotonic() + 300
    while not (_serve_status().get("TTS", {}).get("status") == "HEALTHY" and _running("TTS") == 1):
        assert time.monotonic() < deadline, _serve_status()
        time.sleep(2)

    async def go():
        convs = [Conversation(URL, token=two_gateways.token) for _ in range(3)]
        for c in convs:
            await c.__aenter__()
        stop = asyncio.Event()

        async def talk(c):
            while not stop.is_set():
                await c.say_text("Tell me a long story about the mountains and the rivers.")

        talking = [asyncio.create_task(talk(c)) for c in convs]
        t0 = time.monotonic()
        while await asyncio.to_thread(_running, "TTS") < 2:
            assert time.monotonic() - t0 < 240, "no second TTS replica"
            await asyncio.sleep(2)
        scaled_after = time.monotonic() - t0
        stop.set()
        await asyncio.gather(*talking)
        later = [await c.say_text("And after that?") for c in convs]
        for c in convs:
            await c.__aexit__()
        return scaled_after, later, convs

    scaled_after, later, convs = asyncio.run(go())
    errors = [e["code"] for c in convs for e in c.errors]
    print(json.dumps({"second_tts_replica_running_after_s": round(scaled_after, 1), "errors": errors}))
    for tr in later:  # with two replicas serving
        assert tr.interrupted is False and tr.chunks
    # While the second replica warms up on these 2 cores, the first one's frames can come later than
    # engine_timeout_s (a reply cut with engine_unavailable): the CPU's limit, not the policy's.
    assert set(errors) <= {P.E_ENGINE_UNAVAILABLE}, errors
