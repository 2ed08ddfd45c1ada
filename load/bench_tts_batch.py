"""TTS batch scaling: W streams generated together (one batched frame step) vs the same W
streams one after another, in the same engine, same seeds, same texts.

    python -m load.bench_tts_batch --widths 1,2,4,8,16 --rounds 3              # tiny, CPU, 1 thread
    python -m load.bench_tts_batch --profile full --device cuda --widths 1,8,32  # CSM-1B + Mimi shapes
    python -m load.bench_tts_batch --profile full --device cuda --widths 1,8,32 --frame-graphs  # step from CUDA graphs

Each stream speaks ``--frames`` frames (80 ms each). Per width and round, in random order:
``batched`` opens W streams and steps the engine until all are done; ``serial`` runs each of
them alone on an engine with one slot (a one-stream-at-a-time server: the strongest serial
baseline, since its Mimi decode runs at batch 1). Both include the prompt prefills and Mimi decode. Reported per width (median and
range over rounds): ms per batched step, ms of compute per stream-frame both ways, the paired
ratio serial/batched, and the real-time factor of the batched streams (step ms / 80 ms; below 1
keeps up). Prints a table and one JSON line.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import torch

from pipeline.runtime.threads import keep_large_allocations, pin_torch_threads
from pipeline.tts.config import TTSConfig
from pipeline.tts.engine import TTSEngine

FRAME_MS = 80.0
TEXT = "Thanks for calling, let me look that up for you right away."


def run_batched(engine: TTSEngine, width: int, frames: int, seed0: int) -> tuple[float, int]:
    """Seconds to generate ``width`` streams together, and the engine steps it took."""
    t0 = time.perf_counter()
    streams = [engine.stream(TEXT, max_frames=frames, seed=seed0 + i) for i in range(width)]
    steps = 0
    while not all(s.finished for s in streams):
        engine.step()
        steps += 1
        for s in streams:
            while s.take() is not None:
                pass
    return time.perf_counter() - t0, steps


def run_serial(engine: TTSEngine, width: int, frames: int, seed0: int) -> float:
    t0 = time.perf_counter()
    for i in range(width):
        for _ in engine.stream(TEXT, max_frames=frames, seed=seed0 + i):
            pass
    return time.perf_counter() - t0


def summary(xs: list[float]) -> dict:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profile", default="tiny", choices=["tiny", "full", "real"])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--widths", default="1,2,4,8,16")
    ap.add_argument("--frames", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--frame-graphs", action="store_true", help="replay the frame step from CUDA graphs")
    args = ap.parse_args()
    pin_torch_threads(args.threads)
    keep_large_allocations()
    widths = [int(w) for w in args.widths.split(",")]
    make = {"tiny": TTSConfig.tiny, "full": TTSConfig.full, "real": TTSConfig.real}[args.profile]
    # batched: one slot per stream at the largest width (the step runs the smallest width that fits);
    # serial: an engine with one slot, as a one-stream-at-a-time server runs (same weights and seed)
    engine = TTSEngine(make(device=args.device, num_slots=max(widths), batch_widths=tuple(widths),
                            compile=args.compile, frame_graphs=args.frame_graphs, max_frames=max(args.frames, 12)))
    alone = TTSEngine(make(device=args.device, num_slots=1, compile=args.compile, frame_graphs=args.frame_graphs,
                           max_frames=max(args.frames, 12)))
    for e in (engine, alone):
        e.warmup()
    rng = random.Random(0)
    rows: dict[int, dict[str, list[float]]] = {w: {"step_ms": [], "batched_ms": [], "serial_ms": [], "ratio": []}
                                               for w in widths}
    for r in range(args.rounds):
        jobs = [(w, kind) for w in widths for kind in ("batched", "serial")]
        rng.shuffle(jobs)
        got: dict[tuple[int, str], float] = {}
        for w, kind in jobs:
            seed0 = 1000 * r + 10 * w
            if kind == "batched":
                sec, steps = run_batched(engine, w, args.frames, seed0)
                rows[w]["step_ms"].append(1000 * sec / steps)
            else:
                sec = run_serial(alone, w, args.frames, seed0)
            got[(w, kind)] = 1000 * sec / (w * args.frames)
        for w in widths:
            rows[w]["batched_ms"].append(got[(w, "batched")])
            rows[w]["serial_ms"].append(got[(w, "serial")])
            rows[w]["ratio"].append(got[(w, "serial")] / got[(w, "batched")])
    assert engine.stats()["unseen_shape_calls"] == alone.stats()["unseen_shape_calls"] == 0

    print(f"TTS batch scaling: profile={args.profile} device={args.device} threads={args.threads} "
          f"frames/stream={args.frames} rounds={args.rounds} (median [min-max])")
    print(f"{'width':>5} | {'ms/step':>18} | {'batched ms/stream-frame':>24} | {'serial ms/stream-frame':>23} | "
          f"{'serial/batched':>18} | {'RTF':>5}")
    out = {}
    for w in widths:
        s = {k: summary(v) for k, v in rows[w].items()}
        out[w] = s
        f = lambda d, p=1: f"{d['median']:.{p}f} [{d['min']:.{p}f}-{d['max']:.{p}f}]"  # noqa: E731
        print(f"{w:>5} | {f(s['step_ms']):>18} | {f(s['batched_ms'], 2):>24} | {f(s['serial_ms'], 2):>23} | "
              f"{f(s['ratio'], 2):>18} | {s['step_ms']['median'] / FRAME_MS:>5.2f}")
    print(json.dumps({"bench": "tts_batch", "profile": args.profile, "device": args.device, "threads": args.threads,
                      "compile": args.compile, "frame_graphs": args.frame_graphs,
                      "frames": args.frames, "rounds": args.rounds, "widths": out}))


if __name__ == "__main__":
    with torch.inference_mode():
        main()
