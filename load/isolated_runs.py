"""Running each path of a benchmark in its own process, and reporting what the repeats say.

A path that compiles must not inherit another path's compiled code, so each run is a fresh
``python -m MODULE --path NAME --json-out FILE`` with an empty inductor (and Triton) cache; the
paths run in a random order per repeat. ``paired`` reports a ratio between two paths only when
it stands out of the repeats' own noise. Used by ``load.bench_tts`` and ``load.repro_stall``.
"""
from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import tempfile
import time

import numpy as np

NOISE_FLOOR = 1.25  # a paired ratio closer to 1 than this is never reported, whatever the spreads


def write_result(result: dict, json_out: str | None) -> None:
    """A child's result: into the parent's file, or printed as one JSON line when run by hand."""
    if json_out:
        with open(json_out, "w") as f:
            json.dump(result, f)
    else:
        print(json.dumps(result))


def run_children(names: list[str], repeats: int, argv_for, module: str, prefix: list[str], order_seed: int,
                 timeout_s: float | None = None, label: str = "bench") -> dict[str, list[dict]]:
    """Run ``python -m module --path NAME --json-out F <argv_for(NAME)>`` for every name, ``repeats``
    times, names in a random order per repeat, each process with a fresh empty inductor/Triton
    cache. Returns each name's results in repeat order (a failed run is recorded as ``{"error":..}``)."""
    rng = random.Random(order_seed)
    out: dict[str, list[dict]] = {n: [] for n in names}
    for rep in range(repeats):
        order = list(names)
        rng.shuffle(order)
        print(f"[{label}] repeat {rep + 1}/{repeats}: order {order}", file=sys.stderr, flush=True)
        for name in order:
            with tempfile.TemporaryDirectory(prefix=f"gapless-{label}-{name}-") as d:
                env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=os.path.join(d, "inductor"),
                           TRITON_CACHE_DIR=os.path.join(d, "triton"))
                env.setdefault("OMP_NUM_THREADS", "1")
                f = os.path.join(d, "out.json")
                cmd = [*prefix, sys.executable, "-m", module, "--path", name, "--json-out", f, *argv_for(name)]
                t0 = time.perf_counter()
                try:
                    p = subprocess.run(cmd, env=env, timeout=timeout_s, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                       text=True)
                    ok = p.returncode == 0 and os.path.exists(f)
                    res = json.load(open(f)) if ok else {"error": f"rc={p.returncode}", "tail": p.stdout[-2000:]}
                except subprocess.TimeoutExpired:
                    res = {"error": f"timeout after {timeout_s} s"}
                res["process_s"] = round(time.perf_counter() - t0, 1)
                res["repeat"], res["order"] = rep, order.index(name)
                out[name].append(res)
                status = "ok" if "error" not in res else res["error"]
                print(f"[{label}]   {name}: {status} in {res['process_s']} s", file=sys.stderr, flush=True)
                if "error" in res and "tail" in res:
                    print(res["tail"], file=sys.stderr)
    return out


def med_range(xs: list[float]) -> dict:
    xs = [float(x) for x in xs if x is not None and np.isfinite(x)]
    if not xs:
        return {"median": None, "min": None, "max": None}
    return {"median": round(float(np.median(xs)), 3), "min": round(min(xs), 3), "max": round(max(xs), 3)}


def spread(xs) -> float:
    """max/min of positive values over the repeats (1 = no spread)."""
    xs = [float(x) for x in xs if x is not None and np.isfinite(x) and x > 0]
    return max(xs) / min(xs) if xs else float("inf")


def paired(a: list[float], b: list[float]) -> dict:
    """Per-repeat ratios a[i] / b[i]. Reported (``median`` not None) only when ABOVE NOISE: every
    per-repeat ratio lies beyond the band on the same side of 1, where the band is the larger of
    each side's own spread over the repeats (max/min) and ``NOISE_FLOOR``. Otherwise ``median`` is
    None and ``within_noise`` True (the ratios are still listed)."""
    pairs = [(x, y) for x, y in zip(a, b) if x is not None and y is not None and y > 0 and np.isfinite(x)]
    ratios = [x / y for x, y in pairs]
    band = max(NOISE_FLOOR, spread([x for x, _ in pairs]), spread([y for _, y in pairs]))
    above = bool(ratios) and (min(ratios) > band or max(ratios) < 1 / band)
    return {"median": round(float(np.median(ratios)), 2) if above else None,
            "ratios": [round(r, 2) for r in ratios], "band": round(band, 2), "within_noise": not above}
