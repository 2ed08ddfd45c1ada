"""Where each replica's CPU goes while N conversations run: py-spy samples every replica process.

    python -m load.profile                                # N = 4, 30 s, gateway/stt/llm/tts/proxy
    python -m load.profile --sessions 2 --seconds 20 --roles tts,gateway --native
    python -m load.profile --blocking                     # pause each process while its stack is read

Runs one level of load/concurrency.py (N conversations of typed and spoken turns, loopback only)
and meanwhile runs ``py-spy record --format raw --function`` on each process of the chosen roles
(load/processes.py), sampling ``--rate`` times a second for the level's ``--seconds``. py-spy
needs ptrace on the replicas (root, or CAP_SYS_PTRACE, or a kernel.yama.ptrace_scope of 0). It
leaves idle threads out, so a frame's share of the ticks is about the share of one core the
process spent in it; a thread blocked inside C code called from Python (Ray's ``main_loop``, an
event loop's or a thread pool's wait) is sometimes counted as active all the same (about 7 % of
ticks for ``Worker.main_loop`` in every replica), so those entry frames are an upper bound.

By default py-spy reads the stacks without pausing the process (``--nonblocking``); on the 2-core
VM five replicas at 50 Hz then cost about 0.25 core of kernel time and left N=2 without a gap
over 500 ms. ``--blocking`` pauses each process while its stack is read: there it counted an idle
gateway's waiting threads as over 60 % active, and a paused TTS replica misses Serve's 0.1 s
queue-length probe, so the gateway's turns fail with ``engine_unavailable``. ``--native`` (C/C++
frames: torch, onnxruntime) implies ``--blocking``: a short look at one process only.

For each process it prints the top ``--top`` frames by own time (the frame on top of the stack)
and by total time (anywhere on the stack; thread and worker plumbing left out), as % of ticks,
and the level's gap stats (sampling perturbs what it measures: load/cost.py takes its CPU numbers
without it). Writes each process's raw stacks and a JSON report under ``--out`` (a folder), and
prints one JSON line.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import re
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

from load.client import add_token_argument
from load.concurrency import level_summary, loopback_target, run_level
from load.gaps import PROTOCOLS
from load.processes import session_processes

_COUNT = re.compile(r"^(.*) (\d+)$")
# frames under nearly every stack (thread start-up, Ray's worker entry, thread pools, torch's module
# call wrappers): left out of the ranking by total time, where they would fill the top rows
PLUMBING = ("threading.py", "concurrent/futures/thread.py", "ray/_private/workers/default_worker.py",
            "torch/utils/_contextlib.py", "torch/nn/modules/module.py")
_FILE = re.compile(r"\(([^()]*):\d+\)$")  # py-spy's frame: "function (file:line)"


def parse_raw(text: str) -> Counter:
    """py-spy's raw (collapsed) output, ``root;...;leaf count`` per line, as stack -> count."""
    stacks: Counter = Counter()
    for line in text.splitlines():
        found = _COUNT.match(line.strip())
        if found:
            stacks[tuple(found.group(1).split(";"))] += int(found.group(2))
    return stacks


def top_frames(stacks: Counter, n: int) -> dict[str, list[tuple[str, int]]]:
    """The ``n`` frames with the most samples on top of the stack (own) and anywhere in it (total;
    a recursive frame counts once per stack; PLUMBING frames are left out)."""
    own: Counter = Counter()
    total: Counter = Counter()
    for stack, count in stacks.items():
        own[stack[-1]] += count
        for frame in set(stack):
            if not _plumbing(frame):
                total[frame] += count
    return {"own": own.most_common(n), "total": total.most_common(n)}


def _plumbing(frame: str) -> bool:
    found = _FILE.search(frame)
    return bool(found) and any(found.group(1) == p or found.group(1).endswith("/" + p) for p in PLUMBING)


def py_spy() -> str:
    here = Path(sys.executable).with_name("py-spy")
    found = str(here) if here.exists() else shutil.which("py-spy")
    if not found:
        sys.exit("py-spy is not installed: pip install py-spy (the dev extra)")
    return found


def start_recorders(targets: dict[str, list[int]], seconds: float, rate: int, out: Path, native: bool,
                    blocking: bool) -> list[dict]:
    recorders = []
    for role, pids in targets.items():
        for pid in pids:
            raw = out / f"{role}-{pid}.raw"
            raw.unlink(missing_ok=True)  # a failed attach must not show an earlier run's stacks
            cmd = [py_spy(), "record", "--pid", str(pid), "--duration", str(int(seconds)), "--rate", str(rate),
                   "--format", "raw", "--function", "--output", str(raw)]
            cmd += ["--native"] * native + ["--nonblocking"] * (not blocking)
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            recorders.append({"role": role, "pid": pid, "raw": raw, "proc": proc})
    return recorders


def finish(recorder: dict, ticks: float, top: int) -> dict:
    err, _ = recorder["proc"].communicate()  # py-spy's messages, stdout and stderr together
    result = {"role": recorder["role"], "pid": recorder["pid"], "rc": recorder["proc"].returncode}
    if not recorder["raw"].exists():
        result["error"] = err.strip().splitlines()[-1] if err.strip() else "no output"
        return result
    stacks = parse_raw(recorder["raw"].read_text())
    frames = top_frames(stacks, top)
    pct = lambda c: round(100 * c / ticks, 1)  # noqa: E731
    result.update({"active_pct": pct(sum(stacks.values())),
                   **{kind: [(f, pct(c)) for f, c in rows] for kind, rows in frames.items()}})
    errors = re.search(r"Errors: (\d+)", err)
    result["sample_errors"] = int(errors.group(1)) if errors else None
    return result


def print_profile(result: dict) -> None:
    head = f"{result['role']} (pid {result['pid']})"
    if "error" in result:
        print(f"{head}: py-spy failed (rc {result['rc']}): {result['error']}")
        return
    print(f"{head}: threads active {result['active_pct']}% of ticks (~ % of one core); "
          f"py-spy sampling errors {result['sample_errors']}")
    for kind in ("own", "total"):
        print(f"  by {kind} time:")
        for frame, pct in result[kind]:
            print(f"  {pct:6.1f}%  {frame}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--protocol", choices=PROTOCOLS, default="v1", help="v1 (msgpack) or realtime (OpenAI Realtime)")
    ap.add_argument("--url", default=None, help="default: the protocol's endpoint on 127.0.0.1:8000")
    ap.add_argument("--sessions", type=int, default=4, help="conversations at once while sampling")
    ap.add_argument("--seconds", type=float, default=30, help="duration of the level, and of the sampling")
    ap.add_argument("--roles", default="gateway,stt,llm,tts,proxy", help="comma-separated roles (load/processes.py)")
    ap.add_argument("--rate", type=int, default=50, help="samples per second per process")
    ap.add_argument("--top", type=int, default=10)
    ap.add_argument("--native", action="store_true", help="also sample C/C++ frames (torch, onnxruntime); "
                    "implies --blocking")
    ap.add_argument("--blocking", action="store_true", help="pause each process while its stack is read")
    ap.add_argument("--max-gap-ms", type=float, default=500)
    ap.add_argument("--out", default="out/profile", help="folder for the raw stacks and report.json")
    add_token_argument(ap)
    args = ap.parse_args(argv)
    args.blocking = args.blocking or args.native  # py-spy reads native stacks only of a paused process
    url = loopback_target(args)
    if url is None:
        return 2
    found = session_processes()
    targets = {role: [p.pid for p in found.get(role, ())] for role in args.roles.split(",")}
    if not any(targets.values()):
        print(f"no process for {args.roles} on this machine (is the app up here?)", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    recorders = start_recorders(targets, args.seconds, args.rate, out, args.native, args.blocking)
    level = asyncio.run(run_level(url, args.sessions, args.seconds, False, 0, args.token, args.protocol))
    results = [finish(r, args.rate * int(args.seconds), args.top) for r in recorders]
    for result in results:
        print_profile(result)
    summary = level_summary(level, args.max_gap_ms / 1000)
    print(f"N={args.sessions}: turns {summary['turns']}, gap p50 {summary['gap_p50_ms']} "
          f"max {summary['gap_max_ms']} ms, gaps > {args.max_gap_ms:.0f} ms: {summary['gaps_over_limit']}, "
          f"errors {summary['errors']} {summary['error_codes']}")
    report = {"sessions": args.sessions, "seconds": args.seconds, "rate": args.rate, "native": args.native,
              "blocking": args.blocking, "level": summary, "processes": results}
    (out / "report.json").write_text(json.dumps(report, indent=1))
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
