"""Time to ready of a ``compile: true`` engine, cold compile cache vs warm (pipeline/runtime/compile_cache.py).

    python -m load.bench_ready                                  # STT and TTS, tiny profile, CPU
    python -m load.bench_ready --engines stt --warm-runs 2
    python -m load.bench_ready --engines tts --tts-override num_slots=2 batch_widths=[2] \\
        prefill_buckets=[256] max_seq_len=256 encode_buckets=[25]   # fewer graphs: minutes less cold

Each run is a fresh process (fresh in-memory caches, as a new replica): it builds the engine
config as ``deployments/app.py`` does for ``profile: tiny`` with ``compile: true`` (plus any
``--stt-override`` / ``--tts-override key=value``), then runs ``load_stt`` / ``load_tts``
(build + warm-up) inside :func:`pipeline.runtime.compile_cache.warm_start`, marks the process warm on the
compile counter and serves one short request. The first run uses an empty cache root (cold); the
next runs reuse it (warm); a first run without compile (eager, ``--no-eager`` skips it) is the
floor a warm start approaches. Reported per run: seconds to ready, the cache status from torch's own
counters (FX graph / AOTAutograd cache hits and compiled graphs), compiles during warm-up and
after it (the short request: must be 0), and a checksum of that request's output (cold and warm
must agree). Prints a table and one JSON line. One torch thread per process.
"""
from __future__ import annotations

import argparse
import ast
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time


def parse_overrides(items: list[str], cls) -> dict:
    """``key=value`` pairs (Python/JSON literals; lists become tuples for tuple fields)."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    out = {}
    for item in items:
        key, _, raw = item.partition("=")
        if key not in fields:
            raise SystemExit(f"unknown {cls.__name__} setting {key!r}; known: {sorted(fields)}")
        try:
            value = ast.literal_eval(raw)
        except (ValueError, SyntaxError):
            value = {"true": True, "false": False, "null": None}.get(raw, raw)
        if isinstance(value, list) and "tuple" in str(fields[key].type):
            value = tuple(value)
        out[key] = value
    return out


def engine_config(engine: str, overrides: dict):
    """Like deployments/app.py ``_engine_config`` for ``profile: tiny, device: cpu``, compile on."""
    if engine == "stt":
        from pipeline.stt.config import STTConfig as cls
    else:
        from pipeline.tts.config import TTSConfig as cls
    return dataclasses.replace(cls.tiny(), device="cpu", **{"compile": True, **overrides})


def child(engine: str, root: str, overrides: dict, eager: bool = False) -> dict:
    """One fresh process: warm start the engine, then one short request. Returns the record."""
    t_start = time.perf_counter()
    import numpy as np
    import torch

    torch.set_num_threads(1)
    from pipeline.runtime.compile_cache import warm_start
    from pipeline.runtime.compile_guard import COUNTER
    from pipeline.services import load_stt, load_tts

    cfg = engine_config(engine, overrides)
    if eager:  # the floor: the same engine without torch.compile (warm_start is then a no-op)
        cfg = dataclasses.replace(cfg, compile=False)
    COUNTER.install()
    load = warm_start(engine, cfg, (lambda: load_stt(cfg)) if engine == "stt" else (lambda: load_tts(cfg)), root=root)
    t0 = time.perf_counter()
    eng = load()
    ready_s = time.perf_counter() - t0
    COUNTER.mark_warm()
    compiles_warmup = COUNTER.total
    cache = getattr(load, "cache", None)
    if cache is None:
        status, loaded, cache_dir = "off", False, None
        counts = dict.fromkeys(("fx_hit", "fx_miss", "aot_hit", "aot_miss"), 0)
    else:
        status, counts, loaded, cache_dir = cache.status, cache.counts(), cache.loaded, cache.dir

    t1 = time.perf_counter()
    if engine == "stt":
        from pipeline.audio import speech_like

        eng.open("bench")
        eng.feed("bench", speech_like(3.0, seed=1).astype(np.float32) / 32768.0)
        eng.end("bench")
        tokens = []
        while eng.pending():
            tokens += [t for e in eng.step() if e.kind == "final" for t in e.tokens]
        eng.close("bench")
        checksum = float(sum((i + 1) * t for i, t in enumerate(tokens)))
    else:
        chunks = [c for c in eng.stream("Hello there, how are you today?", max_frames=8, seed=7)]
        checksum = float(sum(np.abs(c.astype(np.float64)).sum() for c in chunks))
    request_s = time.perf_counter() - t1
    return {"engine": engine, "status": status, "artifacts_loaded": loaded, "ready_s": round(ready_s, 2),
            "process_s": round(time.perf_counter() - t_start, 2), "first_request_s": round(request_s, 3),
            "compiles_during_warmup": compiles_warmup, "compiles_after_warmup": COUNTER.after_warmup,
            "fx_graphs_hit": counts["fx_hit"], "fx_graphs_compiled": counts["fx_miss"],
            "aot_hit": counts["aot_hit"], "aot_compiled": counts["aot_miss"],
            "checksum": checksum, "cache_dir": cache_dir, "config": repr(cfg)}


def run_child(engine: str, root: str, overrides: list[str], eager: bool = False) -> dict:
    cmd = [sys.executable, "-m", "load.bench_ready", "--child", engine, "--root", root] + (["--eager"] if eager else [])
    for o in overrides:
        cmd += [f"--{engine}-override", o]
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    p = subprocess.run(cmd, capture_output=True, text=True, env=env)
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
    if p.returncode != 0 or not lines:
        sys.stderr.write(p.stdout[-4000:] + p.stderr[-4000:])
        raise SystemExit(f"{engine} run failed (exit {p.returncode})")
    return json.loads(lines[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engines", default="stt,tts")
    ap.add_argument("--warm-runs", type=int, default=1)
    ap.add_argument("--stt-override", action="append", default=[], metavar="KEY=VALUE", nargs="+")
    ap.add_argument("--tts-override", action="append", default=[], metavar="KEY=VALUE", nargs="+")
    ap.add_argument("--root", help="cache root (default: a fresh temporary directory, removed afterwards)")
    ap.add_argument("--no-eager", action="store_true", help="skip the reference run without compile")
    ap.add_argument("--child", choices=("stt", "tts"), help=argparse.SUPPRESS)
    ap.add_argument("--eager", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    flat = {"stt": [o for group in args.stt_override for o in group],
            "tts": [o for group in args.tts_override for o in group]}
    if args.child:
        from pipeline.stt.config import STTConfig
        from pipeline.tts.config import TTSConfig

        cls = STTConfig if args.child == "stt" else TTSConfig
        print(json.dumps(child(args.child, args.root, parse_overrides(flat[args.child], cls), args.eager)), flush=True)
        return

    root = args.root or tempfile.mkdtemp(prefix="gapless-compile-cache-bench-")
    rows = []
    try:
        for engine in [e.strip() for e in args.engines.split(",") if e.strip()]:
            runs = ([] if args.no_eager else ["eager"]) + ["cold"] + [
                f"warm{i if args.warm_runs > 1 else ''}" for i in range(1, args.warm_runs + 1)]
            for run in runs:
                rec = run_child(engine, root, flat[engine], eager=run == "eager")
                rec["run"] = run
                rows.append(rec)
                print(f"  {engine} {run}: ready in {rec['ready_s']} s ({rec['status']})", file=sys.stderr, flush=True)
    finally:
        if not args.root:
            shutil.rmtree(root, ignore_errors=True)

    head = ("engine", "run", "status", "ready_s", "process_s", "fx_graphs_hit", "fx_graphs_compiled",
            "compiles_during_warmup", "compiles_after_warmup", "first_request_s", "checksum")
    print(" | ".join(head))
    for r in rows:
        print(" | ".join(str(r[h]) for h in head))
    summary = {}
    for engine in {r["engine"] for r in rows}:
        cold = next(r for r in rows if r["engine"] == engine and r["run"] == "cold")
        warm = [r for r in rows if r["engine"] == engine and r["run"].startswith("warm")]
        if warm:
            summary[engine] = {"cold_s": cold["ready_s"], "warm_s": min(r["ready_s"] for r in warm),
                               "speedup": round(cold["ready_s"] / max(min(r["ready_s"] for r in warm), 1e-9), 1),
                               "same_output": all(r["checksum"] == cold["checksum"] for r in warm)}
            eager = [r for r in rows if r["engine"] == engine and r["run"] == "eager"]
            if eager:
                summary[engine]["eager_s"] = eager[0]["ready_s"]
    print(json.dumps({"bench": "ready", "overrides": flat, "summary": summary, "runs": rows}))


if __name__ == "__main__":
    main()
