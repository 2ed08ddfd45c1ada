"""Per-step time of our STT engine at several batch widths (one engine, no baseline: for sizing a
replica, not for a comparison; ``load.bench_stt`` compares against NeMo's pipeline).

    python -m load.bench_stt_widths [--profile tiny|full|real] [--widths 1,8] [--att 13] [--compile] [--threads 1]

Prints the model's calibration (random-weight profiles), then a table of step times per width
(median, p90 over ``--steps`` steps after two untimed ones) and one JSON line.
"""
from __future__ import annotations

import argparse
import json
import time

import numpy as np


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    ap.add_argument("--profile", default="tiny", choices=["tiny", "full", "real"])
    ap.add_argument("--model", default=None, help="a .nemo path or hub id (profile real)")
    ap.add_argument("--widths", default="1,8")
    ap.add_argument("--att", type=int, default=13, help="lookahead frames: 13, 6, 1 or 0")
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default=None, help="float32 | bfloat16 (default: the profile's)")
    return ap.parse_args()


def build_engine(args, widths: list[int]):
    from pipeline.stt.config import STTConfig
    from pipeline.stt.engine import STTEngine

    kw = dict(num_slots=max(widths), compile=args.compile, att_context_size=[70, args.att], device=args.device)
    if args.model:
        kw["model"] = args.model
    if args.dtype:
        kw["dtype"] = args.dtype
    cfg = getattr(STTConfig, args.profile)(**kw)
    t = time.perf_counter()
    engine = STTEngine.from_config(cfg)
    load_s = time.perf_counter() - t
    t = time.perf_counter()
    engine.warmup()
    return engine, load_s, time.perf_counter() - t


def calibration(engine) -> dict:
    """The blank bias a random-weight model was calibrated to, and its token rate on held-out audio."""
    from pipeline.audio import formant_speech
    from pipeline.stt.reference import encoder_frames, offline_tokens

    cal = getattr(engine.model, "_gapless_calibration", None)
    if not cal:
        return {}
    held_out = [formant_speech(8.0, seed=s) for s in (7, 8, 9)]
    rates = [len(offline_tokens(engine.model, pcm)) / encoder_frames(len(pcm)) for pcm in held_out]
    return {**cal, "held_out_tokens_per_frame": [round(r, 3) for r in rates]}


def time_width(engine, width: int, pcm: np.ndarray, steps: int) -> list[float]:
    """Seconds per ``step()`` with ``width`` streams that all have a chunk due every step."""
    ids = [f"bench{i}" for i in range(width)]
    for sid in ids:
        engine.open(sid)
        engine.feed(sid, pcm)
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t)
    for sid in ids:
        engine.close(sid)
    return times[2:]  # the first (first-chunk shape) and one more step untimed


def main() -> None:
    args = parse_args()
    from pipeline.audio import formant_speech
    from pipeline.runtime.threads import pin_torch_threads

    pin_torch_threads(args.threads)
    widths = [int(w) for w in args.widths.split(",")]
    engine, load_s, warmup_s = build_engine(args, widths)
    cal = calibration(engine)
    chunk_ms = engine.framing.n_next * engine.framing.hop * 1000 // engine.sample_rate
    pcm = formant_speech(max(30.0, args.steps * chunk_ms / 1000 + 3), seed=0)
    rows = []
    for width in widths:
        ms = np.array(time_width(engine, width, pcm, args.steps)) * 1e3
        rows.append({"width": width, "step_ms_median": round(float(np.median(ms)), 2),
                     "step_ms_p90": round(float(np.percentile(ms, 90)), 2),
                     "rtf": round(float(np.median(ms)) / chunk_ms, 4)})
    print(f"load {load_s:.1f} s, warm-up {warmup_s:.1f} s, chunk {chunk_ms} ms, {args.threads} thread(s)")
    if cal:
        print(f"calibration: blank bias {cal['blank_bias']:.3f}, {cal['tokens_per_frame']:.3f} tokens/frame; "
              f"held-out {cal['held_out_tokens_per_frame']}")
    print(f"{'width':>5} {'median ms':>10} {'p90 ms':>8} {'RTF':>7}")
    for r in rows:
        print(f"{r['width']:5d} {r['step_ms_median']:10.2f} {r['step_ms_p90']:8.2f} {r['rtf']:7.4f}")
    print(json.dumps({"tool": "bench_stt_widths", "profile": args.profile, "att": args.att, "compile": args.compile,
                      "threads": args.threads, "chunk_ms": chunk_ms, "calibration": cal, "rows": rows}))


if __name__ == "__main__":
    main()
