"""CPU cost of a conversation: CPU seconds per conversation-second for each process of the app.

    python -m load.cost                                  # N = 1, 2, 4, 8; 45 s per level
    python -m load.cost --sessions 1,2 --seconds 20 --out out/cost
    python -m load.cost --protocol realtime              # the same over the OpenAI Realtime endpoint

Runs load/concurrency.py's levels (N conversations of typed and spoken turns at once) against a
server on this machine (loopback only) and reads, with psutil, the CPU time (user + system) of
every process of the app's Ray session before and after each level (load/processes.py): the
gateway, STT, LLM, TTS and ticket-ledger replicas, Ray's HTTP proxy, the Serve controller, the
raylet, the GCS server, and other Ray (the ``serve run`` driver, the dashboard, the monitors, the
agents). Each role's CPU seconds are divided by N x the level's wall time. Before the levels, an
idle baseline (``--baseline`` seconds, no conversation) gives each role's CPU per wall second: what
the app costs with nobody talking. The load client's own CPU (this process, not part of the total)
is reported too, since it shares the machine. Prints a table (rows: roles, columns: N), the gap
stats of each level beside it (p50 / max gap, gaps over ``--max-gap-ms``, errors), and one JSON
line; writes the JSON report to ``--out`` + ``.json``. For where the time goes inside a process,
see load/profile.py. Where ``nvidia-smi`` runs, each level and the baseline also get the GPU's busy
share and peak memory and GPU-seconds per conversation-second (load/gpu_usage.py).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

import psutil

from load.client import add_token_argument
from load.concurrency import level_summary, loopback_target, run_level
from load.gaps import PROTOCOLS
from load.gpu_usage import GPUUsage
from load.processes import SESSION_ROLES, CPUSample, session_cpu

GAP_FIELDS = ("turns", "gap_p50_ms", "gap_max_ms", "gaps_over_limit", "ttfa_p50_ms", "errors")


def spent(before: dict[int, CPUSample], after: dict[int, CPUSample]) -> dict[str, float]:
    """CPU seconds each role spent between two snapshots. A process that started in between counts
    from zero; one that ended in between is lost (its last seconds unread), so it is left out."""
    out = dict.fromkeys(SESSION_ROLES, 0.0)
    for pid, now in after.items():
        then = before.get(pid)
        base = then.cpu_s if then is not None and then.started == now.started else 0.0
        out[now.role] += now.cpu_s - base
    return out


def per_second(cpu: dict[str, float], conversations: int, wall_s: float) -> dict[str, float]:
    """CPU seconds per conversation-second (per wall second with ``conversations=1``), with the total."""
    rates = {role: c / (conversations * wall_s) for role, c in cpu.items()}
    rates["total"] = sum(cpu.values()) / (conversations * wall_s)
    return rates


def client_cpu() -> float:
    t = psutil.Process().cpu_times()
    return t.user + t.system


def measure(run, conversations: int) -> dict:
    """Run ``run()`` (a level, or a sleep) and return what the session's processes spent meanwhile."""
    before, client0, t0 = session_cpu(), client_cpu(), time.monotonic()
    with GPUUsage() as gpu:
        result = run()
    wall = time.monotonic() - t0
    after, client1 = session_cpu(), client_cpu()
    cpu = spent(before, after)
    gone = sorted(set(before) - set(after))
    rates = per_second(cpu, conversations, wall)
    return {"wall_s": round(wall, 2), "cpu_s": {r: round(c, 3) for r, c in cpu.items()},
            "cpu_s_per_conversation_s": {r: round(v, 4) for r, v in rates.items()},
            "cores_busy": round(sum(cpu.values()) / wall, 3),
            "client_cpu_s_per_conversation_s": round((client1 - client0) / (conversations * wall), 4),
            "gpu": gpu.summary(conversations), "processes": len(after), "processes_gone": gone, "result": result}


def print_table(baseline: dict | None, levels: list[dict], max_gap_ms: float) -> None:
    cols = ([("idle/s", baseline)] if baseline else []) + [(f"N={lv['sessions']}", lv) for lv in levels]
    print("CPU seconds per conversation-second (idle/s: per wall second with no conversation)")
    print(f"{'role':<12}" + "".join(f"{name:>10}" for name, _ in cols))
    for role in (*SESSION_ROLES, "total"):
        print(f"{role:<12}" + "".join(f"{c['cpu_s_per_conversation_s'][role]:>10.3f}" for _, c in cols))
    print(f"{'cores busy':<12}" + "".join(f"{c['cores_busy']:>10.2f}" for _, c in cols))
    print(f"{'client':<12}" + "".join(f"{c['client_cpu_s_per_conversation_s']:>10.3f}" for _, c in cols))
    if any(c["gpu"] for _, c in cols):  # GPU-seconds (nvidia-smi's busy share) per conversation-second
        print(f"{'GPU':<12}" + "".join(f"{c['gpu']['gpu_s_per_conversation_s']:>10.3f}" if c["gpu"] else f"{'-':>10}"
                                       for _, c in cols))
    pad = 10 if baseline else 0
    for field in GAP_FIELDS:
        label = "gaps>" + f"{max_gap_ms:.0f}" if field == "gaps_over_limit" else field.removesuffix("_ms")
        print(f"{label:<12}" + " " * pad + "".join(f"{lv[field]!s:>10}" for lv in levels))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--protocol", choices=PROTOCOLS, default="v1", help="v1 (msgpack) or realtime (OpenAI Realtime)")
    ap.add_argument("--url", default=None, help="default: the protocol's endpoint on 127.0.0.1:8000")
    ap.add_argument("--sessions", default="1,2,4,8", help="comma-separated concurrency levels")
    ap.add_argument("--seconds", type=float, default=45, help="duration of each level")
    ap.add_argument("--baseline", type=float, default=10, help="seconds of the idle baseline (0: none)")
    ap.add_argument("--max-gap-ms", type=float, default=500)
    ap.add_argument("--out", default="out/cost", help="the JSON report is written to OUT.json")
    ap.add_argument("--no-progress", action="store_true")
    add_token_argument(ap)
    args = ap.parse_args(argv)
    url = loopback_target(args)
    if url is None:
        return 2
    if not session_cpu():
        print("no gapless gateway replica runs on this machine (is the app up here?)", file=sys.stderr)
        return 2
    baseline = measure(lambda: time.sleep(args.baseline), 1) if args.baseline > 0 else None
    if baseline:
        baseline.pop("result")
    levels = []
    for n in [int(x) for x in args.sessions.split(",")]:
        lv = measure(lambda: asyncio.run(run_level(url, n, args.seconds, not args.no_progress, 0, args.token,
                                                   args.protocol)), n)
        summary = level_summary(lv.pop("result"), args.max_gap_ms / 1000)
        levels.append({**summary, **lv})
    print_table(baseline, levels, args.max_gap_ms)
    report = {"protocol": args.protocol, "seconds": args.seconds, "roles": [*SESSION_ROLES, "total"],
              "baseline": baseline, "levels": levels}
    out = Path(args.out).with_suffix(".json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
