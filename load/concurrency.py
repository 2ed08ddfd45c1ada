"""Load test: N concurrent conversations against a server on loopback, for a bounded time.

    python -m load.concurrency --sessions 1,2,4 --seconds 60 --out out/load
    python -m load.concurrency --sessions 1 --idle 40      # one speaker beside 40 silent sockets
    python -m load.concurrency --sessions 1,2,4 --protocol realtime   # the same over the OpenAI Realtime endpoint

For each N it runs N conversations at once (typed and spoken turns, like the gap test) until
the time is up, then reports p50/p95/p99 of the chunk gap and time to first audio, errors, and
whether any gap exceeded ``--max-gap-ms``. It prints a table and a JSON line, writes a JSON
report and a PNG (gap and time to first audio over time, per N), and states the largest N that
kept zero gaps over the limit. ``--idle K`` holds K more sessions open through each level that
connect and say nothing (a refused one counts as an error). Only loopback targets are allowed.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import time
from pathlib import Path
from urllib.parse import urlparse

import numpy as np

from load.client import add_token_argument
from load.gaps import PROTOCOLS, SPOKEN, TYPED, URLS, client, spoken_audio


async def one_conversation(url: str, token: str | None, idx: int, deadline: float, t0: float, samples: list,
                           errors: list, audio_cache: dict, protocol: str = "v1") -> None:
    try:
        async with client(protocol, url, token) as conv:
            i = idx  # stagger what each session says
            while time.monotonic() < deadline:
                if i % 2 == 0:
                    tr = await conv.say_text(TYPED[i % len(TYPED)])
                else:
                    tr = await conv.say_audio(audio_cache[i % len(SPOKEN)], realtime=True)
                when = tr.done_at - t0
                if tr.time_to_first_audio is not None:
                    samples.append(("ttfa", when, tr.time_to_first_audio))
                samples.extend(("gap", tr.chunk_times[k + 1] - t0, g) for k, g in enumerate(tr.gaps))
                i += 1
            errors.extend(e["code"] for e in conv.errors)
    except Exception as exc:  # noqa: BLE001 - counted, not fatal to the other sessions
        errors.append(f"{type(exc).__name__}")


async def idle_sessions(url: str, token: str | None, k: int, errors: list, stack: contextlib.AsyncExitStack,
                        protocol: str = "v1") -> None:
    """Open ``k`` sessions that say nothing for the rest of the level (closed with ``stack``)."""
    for _ in range(k):
        try:
            conv = await stack.enter_async_context(client(protocol, url, token))
        except Exception as exc:  # noqa: BLE001 - a refused idle socket is an error of the level
            errors.append(f"idle:{type(exc).__name__}")
            continue
        if conv.errors:
            errors.extend(f"idle:{e['code']}" for e in conv.errors)


async def run_level(url: str, n: int, seconds: float, progress: bool, idle: int = 0, token: str | None = None,
                    protocol: str = "v1") -> dict:
    async with contextlib.AsyncExitStack() as stack:
        errors: list = []
        await idle_sessions(url, token, idle, errors, stack, protocol)
        return await _speak_level(url, token, n, seconds, progress, errors, protocol)


async def _speak_level(url: str, token: str | None, n: int, seconds: float, progress: bool, errors: list,
                       protocol: str) -> dict:
    # synthesized before any session starts: nothing may block the event loop mid-conversation
    cache = {k: spoken_audio(k, text)[0] for k, text in enumerate(SPOKEN)}
    t0 = time.monotonic()
    deadline = t0 + seconds
    samples: list = []
    tasks = [asyncio.create_task(one_conversation(url, token, k, deadline, t0, samples, errors, cache, protocol))
             for k in range(n)]
    while not all(t.done() for t in tasks):
        await asyncio.sleep(1)
        if progress:
            done = min(1.0, (time.monotonic() - t0) / seconds)
            bar = "#" * int(30 * done)
            sys.stderr.write(f"\rN={n:<3} [{bar:<30}] {100 * done:5.1f}%  turns~{sum(1 for s in samples if s[0] == 'ttfa')}")
            sys.stderr.flush()
    if progress:
        sys.stderr.write("\n")
    return {"n": n, "samples": samples, "errors": errors}


def level_summary(level: dict, max_gap_s: float) -> dict:
    gaps = np.array([v for k, _, v in level["samples"] if k == "gap"] or [np.nan])
    ttfa = np.array([v for k, _, v in level["samples"] if k == "ttfa"] or [np.nan])

    def pct(a, q):
        return None if np.all(np.isnan(a)) else round(float(np.nanpercentile(a, q)) * 1000, 1)

    return {
        "sessions": level["n"],
        "turns": int(np.sum(~np.isnan(ttfa))),
        "gap_p50_ms": pct(gaps, 50), "gap_p95_ms": pct(gaps, 95), "gap_p99_ms": pct(gaps, 99),
        "gap_max_ms": pct(gaps, 100),
        "gaps_over_limit": int(np.nansum(gaps > max_gap_s)),
        "ttfa_p50_ms": pct(ttfa, 50), "ttfa_p95_ms": pct(ttfa, 95), "ttfa_p99_ms": pct(ttfa, 99),
        "errors": len(level["errors"]), "error_codes": sorted(set(level["errors"])),
    }


def draw(levels: list[dict], max_gap_s: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a1, a2) = plt.subplots(2, 1, figsize=(11, 7), sharex=True)
    for lv in levels:
        g = [(t, v) for k, t, v in lv["samples"] if k == "gap"]
        f = [(t, v) for k, t, v in lv["samples"] if k == "ttfa"]
        if g:
            a1.scatter(*zip(*g), s=4, label=f"N={lv['n']}")
        if f:
            a2.plot(*zip(*sorted(f)), marker="o", markersize=3, label=f"N={lv['n']}")
    a1.axhline(max_gap_s, color="red", linestyle="--", label="limit")
    a1.set_ylabel("chunk gap (s)")
    a2.set_ylabel("time to first audio (s)")
    a2.set_xlabel("seconds into the run")
    a1.legend(fontsize=8)
    a2.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def loopback_target(args) -> str | None:
    """The URL to load (``--url``, or the protocol's endpoint); None, said on stderr, unless it is
    on this machine: the load tools only ever load a server here."""
    url = args.url or URLS[args.protocol]
    host = urlparse(url).hostname or ""
    if not (host == "localhost" or host.startswith("127.") or host == "::1"):
        print(f"refusing to load-test {host}: loopback targets only", file=sys.stderr)
        return None
    return url


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--protocol", choices=PROTOCOLS, default="v1", help="v1 (msgpack) or realtime (OpenAI Realtime)")
    ap.add_argument("--url", default=None, help="default: the protocol's endpoint on 127.0.0.1:8000")
    ap.add_argument("--sessions", default="1,2,4", help="comma-separated concurrency levels")
    ap.add_argument("--seconds", type=float, default=60, help="duration of each level")
    ap.add_argument("--max-gap-ms", type=float, default=500)
    ap.add_argument("--out", default="out/load")
    ap.add_argument("--idle", type=int, default=0, help="silent sessions held open through each level")
    ap.add_argument("--no-progress", action="store_true")
    add_token_argument(ap)
    args = ap.parse_args(argv)
    url = loopback_target(args)
    if url is None:
        return 2
    max_gap_s = args.max_gap_ms / 1000
    levels, rows = [], []
    for n in [int(x) for x in args.sessions.split(",")]:
        lv = asyncio.run(run_level(url, n, args.seconds, not args.no_progress, args.idle, args.token, args.protocol))
        levels.append(lv)
        rows.append(level_summary(lv, max_gap_s))
    print(f"{'N':>3} {'turns':>5} {'gap p50':>8} {'p95':>7} {'p99':>7} {'max':>7} {'>lim':>5} {'ttfa p50':>9} {'p95':>7} {'err':>4}")
    for r in rows:
        print(f"{r['sessions']:>3} {r['turns']:>5} {r['gap_p50_ms']!s:>8} {r['gap_p95_ms']!s:>7} {r['gap_p99_ms']!s:>7} "
              f"{r['gap_max_ms']!s:>7} {r['gaps_over_limit']:>5} {r['ttfa_p50_ms']!s:>9} {r['ttfa_p95_ms']!s:>7} {r['errors']:>4}")
    passing = [r["sessions"] for r in rows if r["gaps_over_limit"] == 0 and r["errors"] == 0 and r["turns"] > 0]
    largest = max(passing) if passing else 0
    print(f"largest N with zero gaps over {args.max_gap_ms:.0f} ms and no errors: {largest}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({"levels": rows, "idle_sessions": args.idle, "largest_passing_n": largest}, indent=1))
    draw(levels, max_gap_s, out.with_suffix(".png"))
    print(json.dumps({"protocol": args.protocol, "largest_passing_n": largest, "idle_sessions": args.idle,
                      "levels": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
