"""Each turn-boundary stall mechanism alone, with the fix beside it (docs/stall.md).

    python -m load.repro_stall                       # CPU: tiny Mimi, inductor, 3 repeats
    python -m load.repro_stall --mimi full           # CPU: full-size Mimi (minutes per compile)
    python -m load.repro_stall --backend aot_eager   # same counts, far less compile time
    python -m load.repro_stall --no-cpu              # on a GPU host: the GPU rows only

Every path runs in its own process with a fresh, empty inductor (and Triton) cache, ``--repeats``
times (default 3), the order of the paths shuffled in every repeat; reported per call: the median
and range (min-max) over the repeats.

CPU paths (always, unless ``--no-cpu``), each encoding ``--seconds`` (new raw lengths):

* ``eager_raw``: eager ``mimi.encode`` at raw lengths: the stalled agent's encode; on CPU there is
  no cuDNN, so no autotune: this is its cost here (no compile, just the work);
* ``compiled_raw``: ``torch.compile(mimi.encode)`` at raw lengths (each new length compiles), then a
  repeat of the first length: the compile variant of the stall;
* ``fix``: lengths padded to fixed buckets, every bucket compiled at warm-up, stance
  ``fail_on_recompile`` afterwards: 0 compiles for the same lengths.

GPU paths (only when CUDA is available and not ``--no-gpu``), eager Mimi encode, one change per
row from the stalled agent's setting (each process starts with one encode of an unrelated length,
so CUDA/cuDNN initialisation is outside every row):

* ``gpu_seed``: ``cudnn.benchmark = True``, raw lengths, no warm-up (the agent);
* ``gpu_bench_off``: the same with ``cudnn.benchmark = False`` (only the flag changed);
* ``gpu_buckets``: benchmark on, lengths padded to buckets and every bucket run once at warm-up on
  the serving thread (only the shapes changed; bucketing implies that warm-up);
* ``gpu_both``: benchmark off and buckets (the engine's setting);
* ``gpu_warm_other_thread`` / ``gpu_warm_same_thread``: benchmark on, raw lengths, the very same
  lengths warmed first on another thread / on the serving thread (cuDNN's cache is per thread).

Per call: the first call of a length (``ms``) and a second call at that length with other data
(``repeat_ms``). Ratios (median of per-repeat ratios of the worst call, vs ``fix`` on CPU and vs
``gpu_both`` on GPU) are printed only where above noise (``load.bench_tts.paired``). Prints a
table and one JSON line.
"""
from __future__ import annotations

import argparse
import json
import shlex
import sys
import threading
import time

import torch

from load.isolated_runs import med_range, paired, run_children, write_result
from pipeline.audio_constants import CODEC_FRAME_SAMPLES, REPLY_RATE
from pipeline.runtime.compile_guard import CompileCounter
from pipeline.tts.mimi import load_mimi

CPU_PATHS = ("eager_raw", "compiled_raw", "fix")
GPU_PATHS = ("gpu_seed", "gpu_bench_off", "gpu_buckets", "gpu_both", "gpu_warm_other_thread", "gpu_warm_same_thread")
INIT_SAMPLES = 5_003  # the process's first encode: a length no row uses
DESCRIBE = {
    "eager_raw": "eager mimi.encode, raw lengths (the agent's encode; no cuDNN on CPU)",
    "compiled_raw": "torch.compile(mimi.encode), raw lengths",
    "fix": "buckets compiled at warm-up, fail_on_recompile",
    "gpu_seed": "benchmark on, raw lengths (the agent)",
    "gpu_bench_off": "benchmark OFF, raw lengths",
    "gpu_buckets": "benchmark on, buckets warmed on the serving thread",
    "gpu_both": "benchmark off + buckets warmed (the engine)",
    "gpu_warm_other_thread": "benchmark on, raw lengths warmed on another thread",
    "gpu_warm_same_thread": "benchmark on, raw lengths warmed on the serving thread",
}


def wav(samples: int, device: str, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(1, 1, samples, generator=g) * 0.3).to(device)


def timed(fn, *args) -> float:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn(*args)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1000


def bucket_of(frames: int, buckets: list[int]) -> int:
    return next((b for b in sorted(buckets) if frames <= b), -(-frames // max(buckets)) * max(buckets))


def padded(n: int, buckets: list[int]) -> int:
    return bucket_of(-(-n // CODEC_FRAME_SAMPLES), buckets) * CODEC_FRAME_SAMPLES


def cpu_path(path: str, args, counter: CompileCounter) -> list[dict]:
    # (no torch._dynamo.reset() here: it would also drop the compile counter's callback)
    mimi = load_mimi(args.mimi, device="cpu")
    lengths = [int(s * REPLY_RATE) for s in args.seconds]
    rows = []
    with torch.inference_mode():
        mimi.encode(wav(CODEC_FRAME_SAMPLES, "cpu"))  # eager first (quantizer tables; see docs/stall.md)
        if path in ("eager_raw", "compiled_raw"):
            enc = mimi.encode if path == "eager_raw" else torch.compile(mimi.encode, backend=args.backend)
            for i, n in enumerate(lengths + lengths[:1]):  # new lengths, then a repeat of the first
                c0 = counter.total
                ms = timed(enc, wav(n, "cpu"))
                rows.append(dict(call=f"{n} samples" + (" again" if i == len(lengths) else ""), samples=n,
                                 compiles=counter.total - c0, ms=round(ms, 1)))
            return rows

        def encode_fn(x):  # its own code object: a dynamo cache of its own
            return mimi.encode(x)

        fixed = torch.compile(encode_fn, dynamic=False, backend=args.backend)
        buckets = sorted({padded(n, args.buckets) for n in lengths})
        c0 = counter.total
        t0 = time.perf_counter()
        for b in buckets:  # warm-up: every bucket once, on this (the serving) thread
            fixed(wav(b, "cpu"))
        rows.append(dict(call=f"warm-up of buckets {[b // CODEC_FRAME_SAMPLES for b in buckets]} frames", samples=0,
                         compiles=counter.total - c0, ms=round((time.perf_counter() - t0) * 1000, 1), warmup=True))
        with torch.compiler.set_stance("fail_on_recompile"):
            for n in lengths:
                b = padded(n, args.buckets)
                c0 = counter.total
                ms = timed(fixed, torch.nn.functional.pad(wav(n, "cpu"), (0, b - n)))
                rows.append(dict(call=f"{n} samples -> bucket {b // CODEC_FRAME_SAMPLES}", samples=n,
                                 compiles=counter.total - c0, ms=round(ms, 1)))
    return rows


def gpu_path(path: str, args) -> list[dict]:
    mimi = load_mimi(args.mimi, device="cuda")
    lengths = [int(s * REPLY_RATE) for s in args.seconds]
    bench = path in ("gpu_seed", "gpu_buckets", "gpu_warm_other_thread", "gpu_warm_same_thread")
    pad = path in ("gpu_buckets", "gpu_both")
    warm_on = {"gpu_buckets": "same", "gpu_both": "same", "gpu_warm_other_thread": "other",
               "gpu_warm_same_thread": "same"}.get(path)
    torch.backends.cudnn.benchmark = bench
    todo = [padded(n, args.buckets) if pad else n for n in lengths]
    rows = []

    def warm() -> None:
        with torch.inference_mode():
            for n in sorted(set(todo)):
                timed(mimi.encode, wav(n, "cuda", seed=2))

    with torch.inference_mode():
        timed(mimi.encode, wav(INIT_SAMPLES, "cuda", seed=3))  # CUDA / cuDNN start-up, outside every row
    if warm_on is not None:
        t0 = time.perf_counter()
        if warm_on == "other":
            t = threading.Thread(target=warm)
            t.start()
            t.join()
        else:
            warm()
        rows.append(dict(call=f"warm-up on {'another' if warm_on == 'other' else 'the serving'} thread", samples=0,
                         compiles=0, ms=round((time.perf_counter() - t0) * 1000, 1), warmup=True))
    with torch.inference_mode():
        for n, m in zip(lengths, todo):
            first = timed(mimi.encode, wav(m, "cuda"))
            again = timed(mimi.encode, wav(m, "cuda", seed=1))
            rows.append(dict(call=f"{n} samples" + (f" -> bucket {m // CODEC_FRAME_SAMPLES}" if pad else ""), samples=n,
                             compiles=0, ms=round(first, 1), repeat_ms=round(again, 1)))
    torch.backends.cudnn.benchmark = False
    return rows


def run_path(args) -> dict:
    torch.set_num_threads(args.threads)
    counter = CompileCounter().install()
    rows = gpu_path(args.path, args) if args.path.startswith("gpu_") else cpu_path(args.path, args, counter)
    serving = [r for r in rows if not r.get("warmup")]
    return dict(path=args.path, rows=rows, max_ms=max(r["ms"] for r in serving),
                compiles_serving=sum(r["compiles"] for r in serving), torch=torch.__version__)


def report(args, paths: list[str], runs: dict[str, list[dict]]) -> dict:
    ok = {p: [r for r in rs if "error" not in r] for p, rs in runs.items()}
    out_paths = {}
    for p, rs in ok.items():
        calls = []
        for i, row in enumerate(rs[0]["rows"] if rs else []):
            same = [r["rows"][i] for r in rs if len(r["rows"]) > i]
            calls.append(dict(call=row["call"], samples=row["samples"],
                              compiles=med_range([c["compiles"] for c in same]),
                              ms=med_range([c["ms"] for c in same]),
                              repeat_ms=med_range([c.get("repeat_ms") for c in same]), warmup=bool(row.get("warmup"))))
        out_paths[p] = dict(what=DESCRIBE[p], runs=len(rs), failed=len(runs[p]) - len(rs), calls=calls,
                            max_ms=med_range([r["max_ms"] for r in rs]),
                            compiles_serving=med_range([r["compiles_serving"] for r in rs]))
    ratios = {}
    for base, group in (("fix", CPU_PATHS), ("gpu_both", GPU_PATHS)):
        if base not in ok:
            continue
        b = {r["repeat"]: r["max_ms"] for r in ok[base]}
        for p in group:
            if p == base or p not in ok:
                continue
            mine = {r["repeat"]: r["max_ms"] for r in ok[p]}
            reps = sorted(set(b) & set(mine))
            ratios[f"{p}/{base} worst call"] = paired([mine[i] for i in reps], [b[i] for i in reps])
    return dict(tool="repro_stall", mimi=args.mimi, backend=args.backend, seconds=args.seconds, buckets=args.buckets,
                repeats=args.repeats, torch=torch.__version__, cuda=torch.cuda.is_available(),
                gpu_part="run" if any(p.startswith("gpu_") for p in paths) else
                ("skipped: --no-gpu" if args.no_gpu else "not run: no CUDA device"),
                paths=out_paths, ratios=ratios)


def fmt(s: dict) -> str:
    if s["median"] is None:
        return "–"
    return f"{s['median']:.1f} ({s['min']:.1f}-{s['max']:.1f})" if s["max"] != s["min"] else f"{s['median']:.1f}"


def print_table(out: dict) -> None:
    print(f"mimi={out['mimi']} backend={out['backend']} repeats={out['repeats']} torch={out['torch']}; "
          f"median (min-max) over repeats, each path its own process with a fresh inductor cache; "
          f"GPU part: {out['gpu_part']}")
    print("| path | call | samples | compiles | ms | repeat ms |")
    print("|---|---|---:|---:|---:|---:|")
    for p, s in out["paths"].items():
        for c in s["calls"]:
            print(f"| {p}: {s['what']} | {c['call']} | {c['samples']} | {'–' if c['compiles']['median'] is None else int(c['compiles']['median'])} | "
                  f"{fmt(c['ms'])} | {fmt(c['repeat_ms'])} |")
    for k, r in out["ratios"].items():
        print(f"{k}: " + (f"{r['median']}x (paired per repeat: {r['ratios']})" if r["median"] is not None
                          else f"within noise {r['ratios']}"))


def child_argv(args) -> list[str]:
    argv = ["--mimi", args.mimi, "--backend", args.backend, "--threads", str(args.threads), "--seconds",
            *map(str, args.seconds), "--buckets", *map(str, args.buckets)]
    return argv


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mimi", choices=["tiny", "full"], default="tiny")
    ap.add_argument("--backend", default="inductor")
    ap.add_argument("--seconds", type=float, nargs="+", default=[1.37, 2.71, 3.33])
    ap.add_argument("--buckets", type=int, nargs="+", default=[25, 50, 100], help="frames of 80 ms")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--no-gpu", action="store_true")
    ap.add_argument("--no-cpu", action="store_true", help="leave out the CPU paths (a GPU host: the GPU rows only)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--order-seed", type=int, default=0)
    ap.add_argument("--child-prefix", default="", help="command prefix of every child process, e.g. 'flock /tmp/x.lock'")
    ap.add_argument("--child-timeout", type=float, default=None, help="seconds per child process")
    ap.add_argument("--path", choices=CPU_PATHS + GPU_PATHS, default=None, help="child mode: this one path")
    ap.add_argument("--json-out", default=None, help="child mode: write the result here")
    args = ap.parse_args(argv)
    if args.path is not None:  # a child: one path in this process
        write_result(run_path(args), args.json_out)
        return
    paths = [] if args.no_cpu else list(CPU_PATHS)
    if torch.cuda.is_available() and not args.no_gpu:
        paths += GPU_PATHS
    runs = run_children(paths, args.repeats, lambda _n: child_argv(args), "load.repro_stall",
                        shlex.split(args.child_prefix), args.order_seed, args.child_timeout, label="repro_stall")
    out = report(args, paths, runs)
    print_table(out)
    print(json.dumps(out))
    if any("error" in r for rs in runs.values() for r in rs):
        sys.exit(1)


if __name__ == "__main__":
    main()
