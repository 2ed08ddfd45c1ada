"""Both wire protocols side by side on one running server: the same 10-turn conversation (typed and
spoken turns, load.gaps') over protocol v1 (msgpack) and over the OpenAI Realtime protocol (JSON +
base64, through the official openai SDK), in a random order each round.

    python -m load.bench_protocols --rounds 3 --turns 10

Per protocol and round: time to first audio (p50 over the turns), the largest gap between audio
chunks, gaps over the limit, and the CPU seconds the gateway and the HTTP proxy spent per second of
reply audio (psutil, load/processes.py). Both sessions are push-to-talk with no VAD (v1:
``?turn_detection=manual&barge_in=off&vad_events=false``; Realtime: ``turn_detection: null``), so the
conversation core does the same work and the difference is the wire. Prints a table (median and range over rounds, and the
median of the per-round ratios realtime / v1) and a JSON line.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys

import numpy as np

from load.client import add_token_argument
from load.gaps import PUSH_TO_TALK, converse, summarize
from load.processes import ProcessCPU

PROTOCOLS = ("v1", "realtime")
FIELDS = ("ttfa_p50_ms", "gap_max_ms", "gaps_over_limit", "gateway_cpu_ms_per_audio_s", "proxy_cpu_ms_per_audio_s")


def one_run(protocol: str, turns: int, token: str | None, max_gap_s: float) -> dict:
    meter = ProcessCPU(("gateway", "proxy"))
    rows, conv = asyncio.run(converse(PUSH_TO_TALK[protocol], turns, realtime=True, token=token, protocol=protocol))
    spent = meter.spent()
    audio_s = sum(r["audio_s"] for r in rows)
    summary = summarize(rows, max_gap_s)
    return {"ttfa_p50_ms": summary["ttfa_p50_ms"], "gap_max_ms": summary["gap_max_ms"],
            "gaps_over_limit": summary["gaps_over_limit"], "audio_s": round(audio_s, 2),
            "errors": len(conv.errors), **{f"{role}_cpu_ms_per_audio_s": round(1000 * cpu / audio_s, 2)
                                           for role, cpu in spent.items()}}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--turns", type=int, default=10)
    ap.add_argument("--max-gap-ms", type=float, default=500)
    ap.add_argument("--seed", type=int, default=0)
    add_token_argument(ap)
    args = ap.parse_args(argv)
    rng = random.Random(args.seed)
    runs: dict[str, list[dict]] = {p: [] for p in PROTOCOLS}
    for r in range(args.rounds):
        order = list(PROTOCOLS)
        rng.shuffle(order)
        for protocol in order:
            runs[protocol].append(one_run(protocol, args.turns, args.token, args.max_gap_ms / 1000))
            print(f"round {r + 1} {protocol}: {runs[protocol][-1]}", file=sys.stderr, flush=True)
    table = {}
    print(f"{'measure':<28} {'v1 median [range]':>24} {'realtime median [range]':>26} {'realtime/v1':>12}")
    for field in FIELDS:
        row = {}
        for p in PROTOCOLS:
            values = [run[field] for run in runs[p]]
            row[p] = {"median": float(np.median(values)), "min": min(values), "max": max(values)}
        pairs = [rt[field] / v1[field] for v1, rt in zip(runs["v1"], runs["realtime"]) if v1[field]]
        row["ratio_median"] = round(float(np.median(pairs)), 3) if pairs else None
        table[field] = row
        fmt = lambda d: f"{d['median']:.1f} [{d['min']:.1f}-{d['max']:.1f}]"  # noqa: E731
        print(f"{field:<28} {fmt(row['v1']):>24} {fmt(row['realtime']):>26} {row['ratio_median']!s:>12}")
    print(json.dumps({"rounds": args.rounds, "turns": args.turns, "table": table, "runs": runs}))
    failed = any(run["gaps_over_limit"] or run["errors"] for p in PROTOCOLS for run in runs[p])
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
