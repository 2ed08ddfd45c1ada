"""Per-step time of the STT engine at several batch widths.

    python -m pipeline.stt.bench [--profile tiny|real] [--widths 1,8] [--att 13] [--compile] [--threads 1]
"""
from __future__ import annotations

import argparse
import time

import numpy as np


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--profile", default="tiny", choices=["tiny", "real"])
    ap.add_argument("--model", default=None)
    ap.add_argument("--widths", default="1,8")
    ap.add_argument("--att", type=int, default=13, help="lookahead frames: 13, 6, 1 or 0")
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()

    from pipeline.runtime import pin_torch_threads

    pin_torch_threads(args.threads)
    from pipeline.stt.config import STTConfig
    from pipeline.stt.engine import STTEngine
    from pipeline.stt.model import encoder_frames, offline_tokens, speech_like_audio

    widths = [int(w) for w in args.widths.split(",")]
    kw = dict(num_slots=max(widths), compile=args.compile, att_context_size=[70, args.att], device=args.device)
    if args.model:
        kw["model"] = args.model
    cfg = STTConfig.tiny(**kw) if args.profile == "tiny" else STTConfig.real(**kw)
    t = time.perf_counter()
    engine = STTEngine.from_config(cfg)
    print(f"load {time.perf_counter() - t:.1f} s")
    cal = getattr(engine.model, "_gapless_calibration", None)
    if cal:
        print(f"calibration: blank bias {cal['blank_bias']:.3f}, {cal['tokens_per_frame']:.3f} tokens/frame")
        rates = [
            len(offline_tokens(engine.model, pcm)) / encoder_frames(len(pcm))
            for pcm in (speech_like_audio(8.0, seed=s) for s in (7, 8, 9))
        ]
        print("tokens/frame on held-out speech-like audio:", ", ".join(f"{r:.3f}" for r in rates))
    t = time.perf_counter()
    engine.warmup()
    print(f"warmup {time.perf_counter() - t:.1f} s")
    chunk_ms = engine.n_next * engine.hop * 1000 // engine.sample_rate
    pcm = speech_like_audio(max(30.0, args.steps * chunk_ms / 1000 + 3), seed=0)
    for width in widths:
        ids = [f"bench{i}" for i in range(width)]
        for sid in ids:
            engine.open(sid)
            engine.feed(sid, pcm)
        times = []
        for _ in range(args.steps):
            t = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - t)
        ms = np.array(times[2:]) * 1e3
        print(
            f"batch {width}: step median {np.median(ms):.1f} ms, p90 {np.percentile(ms, 90):.1f} ms "
            f"per {chunk_ms} ms chunk (real-time factor {np.median(ms) / chunk_ms:.3f})"
        )
        for sid in ids:
            engine.close(sid)


if __name__ == "__main__":
    main()
