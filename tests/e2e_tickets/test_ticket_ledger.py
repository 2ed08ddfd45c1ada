"""A ticket opens one connection across gateway replicas (deployments/tickets.py): the app with two
Gateway replicas and auth on; each ticket is used twice. Ray's proxy spreads handshakes over both
replicas, so with per-replica records about half of the second uses would get in."""
from __future__ import annotations

import asyncio
import json
import secrets

import httpx
import pytest
import websockets
import yaml

from pipeline import protocol as P
from tests.e2e.serve_process import PORT, ROOT, ServeProcess

TICKETS = 8


@pytest.fixture(scope="module")
def two_gateways():
    cfg = yaml.safe_load((ROOT / "serve_config.yaml").read_text())
    app = cfg["applications"][0]
    app["args"]["auth"] = {"mode": "token", "tokens_env": "GAPLESS_TOKENS"}
    for d in app["deployments"]:
        if d["name"] == "Gateway":  # two replicas in the CPU share of one (2 cores in all)
            d["num_replicas"] = 2
            d["ray_actor_options"]["num_cpus"] = d["ray_actor_options"]["num_cpus"] / 2
    path = ROOT / "out" / "serve_config.tickets.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    token = secrets.token_urlsafe(32)
    proc = ServeProcess(str(path), log_path=str(ROOT / "out" / "serve-tickets.log"), env={"GAPLESS_TOKENS": token})
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
