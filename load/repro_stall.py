"""Each turn-boundary stall mechanism alone, with the fix beside it (docs/stall.md).

    python -m load.repro_stall                       # CPU: tiny Mimi, inductor
    python -m load.repro_stall --mimi full           # CPU: full-size Mimi (minutes per compile)
    python -m load.repro_stall --backend aot_eager   # same counts, far less compile time

CPU part (always): ``torch.compile(mimi.encode)`` meeting new input lengths (compiles counted,
each call timed) vs the engine's way (lengths padded to fixed buckets, every bucket run at warm-up,
stance ``fail_on_recompile`` afterwards): 0 compiles for the same lengths.

GPU part (only when CUDA is available): eager Mimi encode with ``cudnn.benchmark`` on, new lengths
(the first call per length pays the algorithm search); warm-up on another thread vs on the serving
thread; and the fix (benchmark off + buckets). Prints a table and one JSON line.
"""
from __future__ import annotations

import argparse
import json
import threading
import time

import numpy as np
import torch

from pipeline.compile_guard import CompileCounter
from pipeline.tts.mimi import FRAME_SIZE, load_mimi

SR = 24_000


def build_mimi(size: str, device: str):
    return load_mimi(size, device=device)  # "full": the real architecture, random weights


def wav(samples: int, device: str, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(1, 1, samples, generator=g) * 0.3).to(device)


def timed(fn, *args) -> float:
    t0 = time.perf_counter()
    fn(*args)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1000


def bucket_of(frames: int, buckets: list[int]) -> int:
    return next(b for b in buckets if frames <= b)


def cpu_part(args, counter: CompileCounter) -> list[dict]:
    # (no torch._dynamo.reset() here: it would also drop the compile counter's callback)
    mimi = build_mimi(args.mimi, "cpu")
    lengths = [int(s * SR) for s in args.seconds]
    rows = []
    naive = torch.compile(mimi.encode, backend=args.backend)  # what the stalled agent had
    with torch.inference_mode():
        mimi.encode(wav(FRAME_SIZE, "cpu"))  # eager first (quantizer tables; see measured facts)
        for n in lengths + lengths[:1]:  # new lengths, then a repeat of the first
            c0 = counter.total
            ms = timed(naive, wav(n, "cpu"))
            rows.append(dict(part="cpu", path="naive: compiled encode, raw lengths", samples=n,
                             compiles=counter.total - c0, ms=round(ms, 1)))

        buckets = sorted({bucket_of(-(-n // FRAME_SIZE), args.buckets) for n in lengths})

        def encode_fn(x):  # its own code object: a cache separate from the naive one's
            return mimi.encode(x)

        fixed = torch.compile(encode_fn, dynamic=False, backend=args.backend)
        c0 = counter.total
        t0 = time.perf_counter()
        for b in buckets:  # warm-up: every bucket once, on this (the serving) thread
            fixed(wav(b * FRAME_SIZE, "cpu"))
        warm_ms = (time.perf_counter() - t0) * 1000
        rows.append(dict(part="cpu", path=f"fix: warm-up of buckets {buckets} frames", samples=0,
                         compiles=counter.total - c0, ms=round(warm_ms, 1)))
        with torch.compiler.set_stance("fail_on_recompile"):
            for n in lengths:
                b = bucket_of(-(-n // FRAME_SIZE), args.buckets)
                x = torch.nn.functional.pad(wav(n, "cpu"), (0, b * FRAME_SIZE - n))
                c0 = counter.total
                ms = timed(fixed, x)
                rows.append(dict(part="cpu", path=f"fix: bucket {b} frames, after warm-up", samples=n,
                                 compiles=counter.total - c0, ms=round(ms, 1)))
    return rows


def gpu_part(args) -> list[dict]:
    rows = []
    mimi = build_mimi(args.mimi, "cuda")
    lengths = [int(s * SR) for s in args.seconds]

    def run(path: str, benchmark: bool, pad: bool, warm_thread: str | None) -> None:
        torch.backends.cudnn.benchmark = benchmark
        todo = [bucket_of(-(-n // FRAME_SIZE), args.buckets) * FRAME_SIZE if pad else n for n in lengths]
        if warm_thread is not None:  # warm every length first, on another thread or this one
            def warm() -> None:
                with torch.inference_mode():
                    for n in set(todo):
                        timed(mimi.encode, wav(n + 0, "cuda"))
            if warm_thread == "other":
                t = threading.Thread(target=warm)
                t.start()
                t.join()
            else:
                warm()
        with torch.inference_mode():
            for n in todo:
                first = timed(mimi.encode, wav(n, "cuda"))
                again = timed(mimi.encode, wav(n, "cuda", seed=1))
                rows.append(dict(part="gpu", path=path, samples=n, compiles=0, ms=round(first, 1),
                                 repeat_ms=round(again, 1)))

    # new lengths each time: offset them so that no earlier run has cached them
    base = list(args.seconds)
    for i, (path, bench, pad, wt) in enumerate([
        ("cudnn.benchmark on, new lengths", True, False, None),
        ("cudnn.benchmark on, warmed on another thread", True, False, "other"),
        ("cudnn.benchmark on, warmed on the serving thread", True, False, "same"),
        ("fix: benchmark off + buckets, warmed on the serving thread", False, True, "same"),
    ]):
        args.seconds = [s + 0.0131 * (i + 1) for s in base]
        run(path, bench, pad, wt)
    args.seconds = base
    torch.backends.cudnn.benchmark = False
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mimi", choices=["tiny", "full"], default="tiny")
    ap.add_argument("--backend", default="inductor")
    ap.add_argument("--seconds", type=float, nargs="+", default=[1.37, 2.71, 3.33])
    ap.add_argument("--buckets", type=int, nargs="+", default=[25, 50, 100], help="frames of 80 ms")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--no-gpu", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    counter = CompileCounter().install()
    rows = cpu_part(args, counter)
    if torch.cuda.is_available() and not args.no_gpu:
        rows += gpu_part(args)
    print(f"{'part':4} {'path':58} {'samples':>8} {'compiles':>8} {'ms':>10} {'repeat_ms':>9}")
    for r in rows:
        print(f"{r['part']:4} {r['path']:58} {r['samples']:8d} {r['compiles']:8d} {r['ms']:10.1f} "
              f"{r.get('repeat_ms', float('nan')):9.1f}")
    naive = [r for r in rows if r["part"] == "cpu" and r["path"].startswith("naive")]
    fixed = [r for r in rows if r["part"] == "cpu" and r["path"].startswith("fix: bucket")]
    print(json.dumps(dict(
        mimi=args.mimi, backend=args.backend, torch=torch.__version__,
        naive_compiles=sum(r["compiles"] for r in naive), naive_max_ms=max(r["ms"] for r in naive),
        fixed_compiles_after_warmup=sum(r["compiles"] for r in fixed), fixed_max_ms=max(r["ms"] for r in fixed),
        rows=rows)))


if __name__ == "__main__":
    main()
