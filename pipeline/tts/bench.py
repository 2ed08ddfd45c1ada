"""Per-frame cost of the TTS engine: ``python -m pipeline.tts.bench [--profile tiny] [--threads 1]``."""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from pipeline.runtime import pin_torch_threads
from pipeline.tts.config import TTSConfig
from pipeline.tts.engine import TTSEngine

FRAME_MS = 80.0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--profile", default="tiny")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    pin_torch_threads(args.threads)
    cfg = (TTSConfig.tiny if args.profile == "tiny" else TTSConfig.real)(device=args.device)
    engine = TTSEngine(cfg)
    engine.warmup()
    text = "Hello, how are you today? I am fine, thank you. What can I do for you?"
    per_frame, first = [], []
    for _ in range(args.runs):
        s = engine.stream(text)
        t0 = time.perf_counter()
        for _chunk in s:
            pass
        per_frame.append((time.perf_counter() - t0) * 1000 / s.frames)
        first.append(s.timings["first_chunk_s"] * 1000)
    with torch.inference_mode():  # CSM alone (one backbone position + 32 sampled codebooks)
        h = engine.csm.prefill(torch.from_numpy(s.prompt_tokens)[None].to(engine.device),
                               torch.from_numpy(s.prompt_mask)[None].to(engine.device))
        codes, times = None, []
        for i in range(30):
            t0 = time.perf_counter()
            codes, h = engine.csm.frame_step(h, codes, len(s.prompt_tokens) + i - 1, cfg.temperature, cfg.top_k,
                                             engine.generator)
            codes.cpu()
            times.append((time.perf_counter() - t0) * 1000)
    med = statistics.median(per_frame)
    print(f"profile={cfg.profile} threads={args.threads} frames/utterance={s.frames}")
    print(f"end-to-end per 80 ms frame (CSM + Mimi decode): median {med:.1f} ms, runs {[round(x, 1) for x in per_frame]}"
          f" -> {FRAME_MS / med:.1f}x real time")
    print(f"CSM frame_step alone: median {statistics.median(times):.1f} ms, min {min(times):.1f} ms")
    print(f"first chunk (prefill + {cfg.first_chunk_frames} frame(s) + decode): median {statistics.median(first):.1f} ms")


if __name__ == "__main__":
    main()
