"""Calls that survive: conversations talk while an operation hits them; what they kept.

    python -m load.survive --op drop --sessions 3 --rounds 3
    RAY_AUTH_MODE=token python -m load.survive --op redeploy --config out/serve_config.two_gateways.yaml \\
        --token "$GAPLESS_TOKEN"

``--op drop``: every conversation's link is cut (no close frame, as a network failure does) at a
random moment, ``--rounds`` times; each client resumes by itself (load/client.py,
docs/protocol.md "Resume"). ``--op redeploy``: ``serve deploy`` of ``--config`` (the config the
app runs) with the Gateway's CPU share changed: a new gateway version, so Serve replaces every
gateway replica, each of which drains (going_away, close 1012) as it stops; the CLI needs
``RAY_AUTH_MODE=token`` to reach a ``serve run`` cluster. ``--change TTS`` (or STT, LLM) changes
that deployment instead: its replica is replaced while the sessions stay where they are, and
the run lasts until ``serve status`` shows the application running again. Typed turns throughout, each waiting for
its reply; ``--after-s`` more seconds of them once the operation is over.

Prints one row (sessions kept, resumes, turns, turns lost, replies cut, the largest gap between
two audio chunks of one reply, the time from each drop to the resumed ``session.ready``) and a
JSON line. A session is kept when every resume of it succeeded; a turn is lost when the server
never had it (a typed one is sent again and counts as kept).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import yaml

from load.client import Conversation, add_token_argument
from load.concurrency import loopback_target

TEXTS = ["Tell me about the weather today.", "What is the capital of France?", "Tell me a story about a ship.",
         "Thanks, and then?"]


async def _talk(c: Conversation, stop: asyncio.Event, rng: random.Random) -> None:
    while not stop.is_set():
        await c.say_text(rng.choice(TEXTS), timeout=120)


async def _resumed(convs: list[Conversation], count: int, timeout_s: float) -> None:
    """Until every conversation has ``count`` finished reconnections (resumed or refused)."""
    deadline = time.monotonic() + timeout_s
    while not all(len(c.resumes) >= count and all(r.resumed_at or r.refused or c.closed for r in c.resumes)
                  for c in convs):
        if time.monotonic() > deadline:
            raise TimeoutError(f"reconnections not finished within {timeout_s} s")
        await asyncio.sleep(0.1)


def changed_config(path: Path, deployment: str = "Gateway") -> Path:
    """``path`` with ``deployment``'s CPU share a tenth smaller, written into out/ (not the tree)."""
    cfg = yaml.safe_load(path.read_text())
    for app in cfg["applications"]:
        for d in app.get("deployments", []):
            if d["name"] == deployment:
                opts = d.setdefault("ray_actor_options", {})
                opts["num_cpus"] = round(float(opts.get("num_cpus", 0.2)) * 0.9, 4)
    out = Path("out") / (path.stem + ".changed.yaml")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return out


def _serve(*args: str, timeout: float = 120) -> str:
    serve = str(Path(sys.executable).parent / "serve")
    return subprocess.run([serve, *args], check=True, timeout=timeout, env=dict(os.environ, RAY_AUTH_MODE="token"),
                          capture_output=True, text=True).stdout


def deploy(path: Path, address: str) -> None:
    _serve("deploy", str(path), "-a", address)


async def _rolled_out(address: str, timeout_s: float) -> None:
    """Until ``serve status`` has shown the application deploying (within 15 s of the deploy) and
    then every application RUNNING (the replaced replicas are up)."""
    deadline, seen_deploying = time.monotonic() + timeout_s, time.monotonic() + 15
    while True:
        status = yaml.safe_load(await asyncio.to_thread(_serve, "status", "-a", address))
        running = all(app["status"] == "RUNNING" for app in status["applications"].values())
        if not running:
            seen_deploying = 0.0
        elif time.monotonic() > seen_deploying:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"the rollout was not over within {timeout_s} s: {status}")
        await asyncio.sleep(0.5)


async def run(args, url: str) -> dict:
    rng = random.Random(args.seed)
    convs = [Conversation(url, token=args.token, resume=True) for _ in range(args.sessions)]
    for c in convs:
        await c.__aenter__()
    stop = asyncio.Event()
    talking = [asyncio.create_task(_talk(c, stop, random.Random(rng.random()))) for c in convs]
    t0 = time.monotonic()
    if args.op == "drop":
        for r in range(1, args.rounds + 1):
            for c in rng.sample(convs, len(convs)):
                await asyncio.sleep(rng.uniform(0.3, 1.5))
                c.drop()
            await _resumed(convs, r, args.resume_timeout_s)
    else:
        await asyncio.sleep(1.0)
        await asyncio.to_thread(deploy, changed_config(Path(args.config), args.change), args.dashboard)
        if args.change != "Gateway":  # the gateways stay: no session moves; the model replica is replaced
            await _rolled_out(args.dashboard, args.resume_timeout_s)
        else:
            await _resumed(convs, 1, args.resume_timeout_s)
            quiet_since = time.monotonic()  # every session resumed once: wait for the rollout's later drains
            while time.monotonic() - quiet_since < args.settle_s:
                await asyncio.sleep(0.2)
                if any(r.resumed_at is None and not r.refused for c in convs for r in c.resumes):
                    quiet_since = time.monotonic()
    operation_s = time.monotonic() - t0
    await asyncio.sleep(args.after_s)
    stop.set()
    await asyncio.gather(*talking, return_exceptions=True)
    for c in convs:
        await c.__aexit__()
    return summarise(args, convs, operation_s)


def summarise(args, convs: list[Conversation], operation_s: float) -> dict:
    turns = [tr for c in convs for tr in c.turns.values()]
    gaps = [g for tr in turns for g in tr.gaps]
    recover = [r.after_s for c in convs for r in c.resumes if r.after_s is not None]
    return {
        "op": args.op, "sessions": len(convs),
        "kept": sum(all(r.resumed_at for r in c.resumes) for c in convs),
        "resumes": sum(len(c.resumes) for c in convs),
        "close_codes": sorted({int(r.close_code or 0) for c in convs for r in c.resumes}),
        "turns": len(turns), "lost": sum(tr.lost for tr in turns), "cut": sum(bool(tr.interrupted) for tr in turns),
        "gap_max_ms": round(1000 * max(gaps), 1) if gaps else None,
        "recover_p50_ms": round(1000 * float(np.median(recover)), 1) if recover else None,
        "recover_max_ms": round(1000 * max(recover), 1) if recover else None,
        "operation_s": round(operation_s, 1),
        "errors": [e["code"] for c in convs for e in c.errors],
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--op", choices=("drop", "redeploy"), default="drop")
    ap.add_argument("--url", default=None, help="default: protocol v1 on 127.0.0.1:8000")
    ap.add_argument("--sessions", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=3, help="--op drop: drops per conversation")
    ap.add_argument("--config", default="serve_config.yaml", help="--op redeploy: the config the app runs")
    ap.add_argument("--change", default="Gateway", choices=("Gateway", "STT", "LLM", "TTS"),
                    help="--op redeploy: the deployment whose config changes (its CPU share), so Serve replaces it")
    ap.add_argument("--dashboard", default="http://127.0.0.1:8265", help="--op redeploy: Ray's dashboard")
    ap.add_argument("--settle-s", type=float, default=15.0, help="--op redeploy: no reconnection this long ends it")
    ap.add_argument("--after-s", type=float, default=10.0, help="talking on after the operation")
    ap.add_argument("--resume-timeout-s", type=float, default=90.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--protocol", default="v1", help=argparse.SUPPRESS)  # for loopback_target
    add_token_argument(ap)
    args = ap.parse_args(argv)
    url = loopback_target(args)
    if url is None:
        return 2
    row = asyncio.run(run(args, url))
    cols = ("op", "sessions", "kept", "resumes", "turns", "lost", "cut", "gap_max_ms", "recover_p50_ms",
            "recover_max_ms", "operation_s")
    print(" | ".join(cols))
    print(" | ".join(str(row[k]) for k in cols))
    print(json.dumps(row))
    return 0 if row["kept"] == row["sessions"] and not row["lost"] else 1


if __name__ == "__main__":
    sys.exit(main())
