"""Multi-turn TTS benchmark: our engine vs the naive path, same run, same conversation.

    python -m load.bench_tts                          # tiny, CPU, compile with inductor
    python -m load.bench_tts --backend aot_eager      # same shapes/guards, little compile time
    python -m load.bench_tts --profile full --device cuda   # CSM-1B + Mimi shapes, random weights

(a) ours: ``TTSEngine`` with ``compile`` on, warmed (every prefill bucket, the frame step, each
    decode chunk size, each encode bucket); each user turn encoded once with
    ``encode_user_audio`` (bucketed); bot turns reuse their generated codes.
(b) naive: the same generator, but every turn re-encodes the whole history's audio (user audio
    and the bot's own generated audio) at raw lengths with ``torch.compile(mimi.encode)`` under
    torch's default stance (a new length compiles on demand).

Per turn: time from the end of the user's turn to the first audio chunk (TTFA, including the
encode), real-time factor of the reply, gaps between consecutive chunks of a reply. Prints a
table and one JSON line (with naive/ours ratios).
"""
from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch

from pipeline.audio import int16_to_float, resample, speech_like
from pipeline.compile_guard import CompileCounter
from pipeline.tts.config import TTSConfig
from pipeline.tts.engine import Segment, TTSEngine

USER_SECONDS = [0.9, 1.7, 0.45, 2.6, 1.25, 3.1, 0.7, 2.2, 1.45, 0.33]
REPLIES = [
    "Hello!",
    "Sure, I can help you with that.",
    "Okay.",
    "The train leaves at seven, and it takes about two hours to get there.",
    "Yes, that works.",
    "Let me check the calendar for next week before I confirm anything.",
    "Done.",
    "You are welcome, have a great evening!",
    "No problem at all.",
    "Goodbye.",
]


def pct(xs: list[float], q: float) -> float:
    return float(np.percentile(xs, q)) if xs else float("nan")


def run_reply(engine: TTSEngine, text: str, context: list[Segment], t_turn_end: float, rec: dict):
    s = engine.stream(text, context=context)
    stamps, chunks = [], []
    t_gen = time.perf_counter()
    for c in s:
        stamps.append(time.perf_counter())
        chunks.append(c)
    audio_s = sum(len(c) for c in chunks) / engine.sample_rate
    rec["ttfa_ms"].append((stamps[0] - t_turn_end) * 1000)
    rec["rtf"].append((stamps[-1] - t_gen) / max(audio_s, 1e-9))
    rec["gaps_ms"] += list(np.diff(stamps) * 1000)
    return s.codes, np.concatenate(chunks)


def ours(engine: TTSEngine, turns, counter: CompileCounter) -> dict:
    rec = dict(ttfa_ms=[], rtf=[], gaps_ms=[], encode_ms=[])
    c0 = counter.total
    context: list[Segment] = []
    for i, (pcm16, text) in enumerate(turns):
        t_end = time.perf_counter()
        codes = engine.encode_user_audio(pcm16)  # once per user turn, bucketed
        rec["encode_ms"].append((time.perf_counter() - t_end) * 1000)
        context.append(Segment(1, f"user {i}", codes))
        bot_codes, _ = run_reply(engine, text, context, t_end, rec)
        context.append(Segment(0, text, bot_codes))  # the generated codes, never re-encoded
    rec["compiles"] = counter.total - c0
    return rec


def naive(engine: TTSEngine, turns, counter: CompileCounter, backend: str) -> dict:
    rec = dict(ttfa_ms=[], rtf=[], gaps_ms=[], encode_ms=[])
    encode = torch.compile(engine.mimi.encode, backend=backend)  # compile on demand, raw lengths
    c0 = counter.total
    history: list[tuple[int, str, np.ndarray]] = []  # (speaker, text, 24 kHz float audio)
    with torch.compiler.set_stance("default"):
        for i, (pcm16, text) in enumerate(turns):
            t_end = time.perf_counter()
            history.append((1, f"user {i}", resample(int16_to_float(pcm16), 16_000, 24_000)))
            context = []
            with torch.inference_mode():
                for spk, txt, wav in history:  # the whole history, every turn
                    codes = encode(torch.from_numpy(wav).view(1, 1, -1).to(engine.device))[0].T
                    context.append(Segment(spk, txt, codes.cpu().numpy().astype(np.int64)))
            rec["encode_ms"].append((time.perf_counter() - t_end) * 1000)
            _, pcm = run_reply(engine, text, context, t_end, rec)
            history.append((0, text, int16_to_float(pcm)))
    rec["compiles"] = counter.total - c0
    return rec


def summary(rec: dict) -> dict:
    return dict(
        ttfa_p50_ms=pct(rec["ttfa_ms"], 50), ttfa_max_ms=max(rec["ttfa_ms"]),
        encode_max_ms=max(rec["encode_ms"]), rtf_mean=float(np.mean(rec["rtf"])),
        gap_p50_ms=pct(rec["gaps_ms"], 50), gap_p99_ms=pct(rec["gaps_ms"], 99),
        gap_max_ms=max(rec["gaps_ms"]) if rec["gaps_ms"] else float("nan"),
        compiles_after_warmup=rec["compiles"],
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profile", choices=["tiny", "full"], default="tiny")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--backend", default="inductor")
    ap.add_argument("--no-compile", action="store_true", help="ours without torch.compile (eager)")
    ap.add_argument("--no-naive", action="store_true")
    ap.add_argument("--max-frames", type=int, default=None, help="cap frames per reply (full on CPU: 2)")
    ap.add_argument("--max-seq-len", type=int, default=None, help="KV cache rows (the largest prefill bucket)")
    ap.add_argument("--encode-buckets", type=int, nargs="+", default=None, help="frames of 80 ms")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    counter = CompileCounter().install()

    over = dict(device=args.device, compile=not args.no_compile, compile_backend=args.backend)
    if args.max_frames:
        over.update(max_frames=args.max_frames, min_frames=1)
    if args.encode_buckets:
        over.update(encode_buckets=tuple(args.encode_buckets))
    if args.max_seq_len:
        over.update(max_seq_len=args.max_seq_len)
    if args.profile == "tiny":
        over.setdefault("max_seq_len", 512)
        cfg = TTSConfig.tiny(max_frames=over.pop("max_frames", 24), **over)
    else:
        cfg = TTSConfig.full(dtype="bfloat16" if args.device == "cuda" else "float32", **over)
    t0 = time.perf_counter()
    engine = TTSEngine(cfg)
    load_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    engine.warmup()
    warm_s = time.perf_counter() - t0
    counter.mark_warm()

    n = args.turns
    turns = [(speech_like(USER_SECONDS[i % len(USER_SECONDS)] + 0.01 * (i // len(USER_SECONDS)), 16_000, seed=i),
              REPLIES[i % len(REPLIES)]) for i in range(n)]
    results = {"ours": summary(ours(engine, turns, counter))}
    if not args.no_naive:
        results["naive"] = summary(naive(engine, turns, counter, args.backend))

    keys = ["ttfa_p50_ms", "ttfa_max_ms", "encode_max_ms", "rtf_mean", "gap_p50_ms", "gap_p99_ms", "gap_max_ms",
            "compiles_after_warmup"]
    print(f"profile={args.profile} device={args.device} compile={cfg.compile} backend={args.backend} turns={n} "
          f"load {load_s:.1f} s, warm-up {warm_s:.1f} s, prefill buckets {engine.prefill_buckets}, "
          f"encode buckets {engine.encode_buckets}")
    print(f"{'path':6} " + " ".join(f"{k:>21}" for k in keys))
    for name, r in results.items():
        print(f"{name:6} " + " ".join(f"{r[k]:21.2f}" if isinstance(r[k], float) else f"{r[k]:21d}" for k in keys))
    out = dict(profile=args.profile, device=args.device, backend=args.backend, compile=cfg.compile, turns=n,
               warmup_s=round(warm_s, 2), **{f"{p}_{k}": round(v, 3) for p, r in results.items() for k, v in r.items()},
               engine_unseen_shape_calls=engine.stats()["unseen_shape_calls"])
    if "naive" in results:
        for k in ("ttfa_max_ms", "encode_max_ms", "gap_max_ms", "ttfa_p50_ms"):
            out[f"ratio_{k}"] = round(results["naive"][k] / max(results["ours"][k], 1e-9), 2)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
