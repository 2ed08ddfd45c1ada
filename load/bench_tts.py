"""Multi-turn TTS benchmark at the turn boundary: our engine vs what the stalled agent did.

    python -m load.bench_tts --backend aot_eager      # tiny, CPU: 3 paths x 3 repeats, one process each
    python -m load.bench_tts                          # the same with inductor (minutes per compile on 2 cores)
    python -m load.bench_tts --profile full --device cuda   # CSM-1B + Mimi shapes, random weights

Paths (``--paths``, default all three), each on the same conversation (``--turns`` user turns of
0.33-3.1 s, a reply each), each in its own process:

ours
    ``TTSEngine`` with ``compile`` on, warmed (every prefill bucket, the frame step, each decode
    chunk size, each encode bucket); each user turn encoded once with ``encode_user_audio``
    (bucketed); bot turns reuse their generated codes; compiler stance ``eager_on_recompile``.
seed
    What the stalled agent did (docs/stall.md), driven through the same engine: every turn, an
    EAGER ``mimi.encode`` (no torch.compile) at raw lengths of the reference clips
    (``--ref-seconds``, the bot's voice prompt) and of the last ``--context-segments`` segments of
    the conversation, both sides (user audio and the bot's own generated audio, re-encoded);
    ``cudnn.benchmark = True`` on CUDA; the backbone prefill ``torch.compile``d
    (``dynamic=False``) at RAW prompt lengths, so a new prompt length compiles (dynamo's
    recompile limit raised to 64, as the reporter did, so that no length falls back to eager).
    The per-frame step is ours (compiled, one shape, warmed): only the turn boundary differs.
    On CPU the GPU-only parts are absent: no cuDNN (so no autotune) and no CUDA graphs; the
    output says so.
compiled_raw
    Not the agent's behaviour, a worst case (formerly called "naive"): every turn re-encodes the
    WHOLE history's audio (no cap, no reference clips) with ``torch.compile(mimi.encode)`` at raw
    lengths (each new length compiles), then our bucketed prefill and frame step.

The parent process runs every path ``--repeats`` times (default 3), the order of the paths
shuffled in every repeat, each run as ``python -m load.bench_tts --path P --json-out F`` with a
fresh, empty ``TORCHINDUCTOR_CACHE_DIR`` (and Triton cache), so no run reuses another's compiled
graphs. Per turn: time from the end of the user's turn to the first audio chunk (TTFA: encode,
prefill, first frame step and decode), the encode and prefill times, real-time factor of the
reply after its first chunk, gaps between consecutive chunks. Reported: per path the median and range (min-max) over
the repeats; per path the median of its per-repeat ratios to ``ours`` only where it is above
noise (see :func:`load.isolated_runs.paired`). Prints a table and one JSON line.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import shlex
import sys
import time

import numpy as np
import torch

from load.isolated_runs import NOISE_FLOOR, med_range, paired, run_children, write_result
from pipeline.audio import int16_to_float, resample, speech_like
from pipeline.audio_constants import REPLY_RATE, USER_RATE
from pipeline.runtime.compile_guard import CompileCounter
from pipeline.tts.config import TTSConfig
from pipeline.tts.engine import Segment, TTSEngine
from pipeline.tts.clip_encoder import mimi_encode
from pipeline.tts.shape_gate import ShapeGate

PATHS = ("ours", "seed", "compiled_raw")
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
METRICS = ("ttfa_p50_ms", "ttfa_max_ms", "encode_max_ms", "prefill_max_ms", "rtf_mean", "gap_p50_ms",
           "gap_max_ms", "compiles_after_warmup", "warmup_s")
RATIO_METRICS = ("ttfa_p50_ms", "ttfa_max_ms", "encode_max_ms", "prefill_max_ms", "gap_max_ms")


def pct(xs: list[float], q: float) -> float:
    return float(np.percentile(xs, q)) if xs else float("nan")


# -- one path, in this process -----------------------------------------------------------------------
def run_reply(engine: TTSEngine, text: str, context: list[Segment], t_turn_end: float, rec: dict):
    s = engine.stream(text, context=context)
    stamps, chunks = [], []
    for c in s:
        stamps.append(time.perf_counter())
        chunks.append(c)
    later_s = sum(len(c) for c in chunks[1:]) / engine.sample_rate  # audio after the first chunk
    rec["ttfa_ms"].append((stamps[0] - t_turn_end) * 1000)
    rec["prefill_ms"].append(s.timings.get("prefill_s", float("nan")) * 1000)
    rec["prompt_rows"].append(len(s.prompt_tokens))
    if later_s > 0:  # generation speed inside the reply (the boundary is TTFA's)
        rec["rtf"].append((stamps[-1] - stamps[0]) / later_s)
    rec["gaps_ms"] += list(np.diff(stamps) * 1000)
    return s.codes, np.concatenate(chunks)


def new_rec() -> dict:
    return dict(ttfa_ms=[], rtf=[], gaps_ms=[], encode_ms=[], prefill_ms=[], prompt_rows=[])


def ours(engine: TTSEngine, turns, counter: CompileCounter, args) -> dict:
    rec = new_rec()
    c0 = counter.total
    context: list[Segment] = []
    for i, (pcm16, text) in enumerate(turns):
        t_end = time.perf_counter()
        codes = engine.encoder.encode_user_audio(pcm16)  # once per user turn, bucketed
        rec["encode_ms"].append((time.perf_counter() - t_end) * 1000)
        context.append(Segment(1, f"user {i}", codes))
        bot_codes, _ = run_reply(engine, text, context, t_end, rec)
        context.append(Segment(0, text, bot_codes))  # the generated codes, never re-encoded
    rec["compiles"] = counter.total - c0
    return rec


def encode_raw(engine: TTSEngine, encode, wav: np.ndarray) -> np.ndarray:
    """Float 24 kHz audio -> codes [T, 32] through ``encode`` at its raw length (no padding)."""
    with torch.inference_mode():
        codes = encode(torch.from_numpy(np.ascontiguousarray(wav, dtype=np.float32)).view(1, 1, -1).to(engine.device))
    return codes[0].T.cpu().numpy().astype(np.int64)


def reference_clips(args) -> list[tuple[int, str, np.ndarray]]:
    """The bot's voice prompt: speech-like clips at 24 kHz, speaker 0 (the bot)."""
    return [(0, f"reference clip {j}", int16_to_float(speech_like(sec, REPLY_RATE, seed=100 + j)))
            for j, sec in enumerate(args.ref_seconds)]


def seed(engine: TTSEngine, turns, counter: CompileCounter, args) -> dict:
    rec = new_rec()
    refs = reference_clips(args)
    c0 = counter.total
    history: list[tuple[int, str, np.ndarray]] = []  # (speaker, text, 24 kHz float audio), both sides
    for i, (pcm16, text) in enumerate(turns):
        t_end = time.perf_counter()
        history.append((1, f"user {i}", resample(int16_to_float(pcm16), USER_RATE, REPLY_RATE)))
        kept = history[-args.context_segments:] if args.context_segments > 0 else []
        # every turn: eager encode, raw lengths, the reference clips and the capped context
        context = [Segment(spk, txt, encode_raw(engine, engine.mimi.encode, wav)) for spk, txt, wav in refs + kept]
        rec["encode_ms"].append((time.perf_counter() - t_end) * 1000)
        _, pcm = run_reply(engine, text, context, t_end, rec)
        history.append((0, text, int16_to_float(pcm)))  # the bot's own audio, re-encoded next turn
    rec["compiles"] = counter.total - c0
    return rec


def compiled_raw(engine: TTSEngine, turns, counter: CompileCounter, args) -> dict:
    rec = new_rec()
    encode = torch.compile(engine.mimi.encode, backend=args.backend)  # compile on demand, raw lengths
    c0 = counter.total
    history: list[tuple[int, str, np.ndarray]] = []
    with torch.compiler.set_stance("default"):
        for i, (pcm16, text) in enumerate(turns):
            t_end = time.perf_counter()
            history.append((1, f"user {i}", resample(int16_to_float(pcm16), USER_RATE, REPLY_RATE)))
            context = [Segment(spk, txt, encode_raw(engine, encode, wav)) for spk, txt, wav in history]  # all of it
            rec["encode_ms"].append((time.perf_counter() - t_end) * 1000)
            _, pcm = run_reply(engine, text, context, t_end, rec)
            history.append((0, text, int16_to_float(pcm)))
    rec["compiles"] = counter.total - c0
    return rec


def seed_prefill(engine: TTSEngine, backend: str):
    """The stalled agent's prefill: the backbone compiled at the RAW prompt length (dynamic=False:
    every new length is a new graph), written into cache row ``row``; replaces ``engine.prefill``."""
    cuda_graphs = engine.device.type == "cuda" and backend == "inductor"
    kw = dict(dynamic=False, fullgraph=True, backend=backend)
    if cuda_graphs:
        kw["mode"] = "reduce-overhead"

    def prefill_raw_fn(tokens, mask, last, row):  # its own code object: a dynamo cache of its own
        return engine.csm.prefill_at(tokens, mask, last, row)

    compiled = torch.compile(prefill_raw_fn, **kw)

    @torch.inference_mode()
    def prefill(tokens: np.ndarray, mask: np.ndarray, row: int = 0) -> torch.Tensor:
        dev = engine.device
        last = torch.tensor([len(tokens) - 1], dtype=torch.long, device=dev)
        slot = torch.tensor([row], dtype=torch.long, device=dev)
        if cuda_graphs:
            torch.compiler.cudagraph_mark_step_begin()
        h = compiled(torch.from_numpy(tokens).to(dev)[None], torch.from_numpy(mask).to(dev)[None], last, slot)
        return h.clone() if dev.type == "cuda" else h

    return prefill


def build_engine(args, path: str) -> TTSEngine:
    over = dict(device=args.device, compile=not args.no_compile, compile_backend=args.backend, num_slots=args.slots)
    if args.max_frames:
        over.update(max_frames=args.max_frames, min_frames=1)
    if args.encode_buckets:
        over.update(encode_buckets=tuple(args.encode_buckets))
    if args.max_seq_len:
        over.update(max_seq_len=args.max_seq_len)
    if path == "seed":
        # compiled backbone (as the agent had it), torch's default stance after warm-up (a new
        # prompt length compiles), cuDNN autotune on (CUDA only), one prefill bucket: the engine's
        # warm-up then runs our raw-length prefill once at max_seq_len rows, plus its test utterance
        over.update(compile=True, stance_after_warmup="default", cudnn_benchmark=True, prefill_buckets=(1 << 30,))
    if args.profile == "tiny":
        over.setdefault("max_seq_len", 512)
        cfg = TTSConfig.tiny(max_frames=over.pop("max_frames", 24), **over)
    else:
        cfg = TTSConfig.full(dtype="bfloat16" if args.device == "cuda" else "float32", **over)
    engine = TTSEngine(cfg)
    if path in ("seed", "compiled_raw"):
        # these paths never call the engine's bucketed encode: keep it eager so that warm-up does
        # not spend minutes compiling buckets they do not use (nothing they time runs through it)
        eager = ShapeGate("encode", functools.partial(mimi_encode, engine.mimi), None, cfg.slow_step_ms)
        engine.fns["encode"] = engine.encoder.encode_fn = eager
    if path == "seed":
        engine.fns["prefill"] = ShapeGate("prefill", engine.csm.prefill_at, None, cfg.slow_step_ms)  # unused
        engine.prefill = seed_prefill(engine, args.backend)
        for name in ("recompile_limit", "cache_size_limit"):
            if hasattr(torch._dynamo.config, name):
                setattr(torch._dynamo.config, name, max(64, getattr(torch._dynamo.config, name)))
    return engine


def conversation(n: int) -> list[tuple[np.ndarray, str]]:
    return [(speech_like(USER_SECONDS[i % len(USER_SECONDS)] + 0.01 * (i // len(USER_SECONDS)), USER_RATE, seed=i),
             REPLIES[i % len(REPLIES)]) for i in range(n)]


def summary(rec: dict) -> dict:
    return dict(
        ttfa_p50_ms=pct(rec["ttfa_ms"], 50), ttfa_max_ms=max(rec["ttfa_ms"]),
        encode_max_ms=max(rec["encode_ms"]), prefill_max_ms=float(np.nanmax(rec["prefill_ms"])),
        rtf_mean=float(np.mean(rec["rtf"])),
        gap_p50_ms=pct(rec["gaps_ms"], 50), gap_p99_ms=pct(rec["gaps_ms"], 99),
        gap_max_ms=max(rec["gaps_ms"]) if rec["gaps_ms"] else float("nan"),
        compiles_after_warmup=rec["compiles"],
        ttfa_ms=[round(x, 1) for x in rec["ttfa_ms"]], prompt_rows=rec["prompt_rows"],
    )


def absent_on_this_device(device: str) -> list[str]:
    if device == "cuda":
        return []
    return ["seed: cudnn.benchmark autotune (no cuDNN on CPU)", "seed: CUDA-graph capture per prompt length",
            "ours: reduce-overhead CUDA graphs"]


def run_path(args) -> dict:
    torch.set_num_threads(args.threads)
    counter = CompileCounter().install()
    t0 = time.perf_counter()
    engine = build_engine(args, args.path)
    load_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    engine.warmup()
    warm_s = time.perf_counter() - t0
    counter.mark_warm()
    fn = {"ours": ours, "seed": seed, "compiled_raw": compiled_raw}[args.path]
    r = summary(fn(engine, conversation(args.turns), counter, args))
    r.update(path=args.path, load_s=round(load_s, 2), warmup_s=round(warm_s, 2),
             unseen_shape_calls=engine.stats()["unseen_shape_calls"],
             cudnn_benchmark=bool(torch.backends.cudnn.benchmark) if args.device == "cuda" else None,
             prefill_buckets=list(engine.prefill_buckets) if args.path != "seed" else "raw lengths",
             encode_buckets=list(engine.encoder.buckets) if args.path == "ours" else "raw lengths",
             torch=torch.__version__, inductor_cache=os.environ.get("TORCHINDUCTOR_CACHE_DIR"))
    return r


def report(args, runs: dict[str, list[dict]]) -> dict:
    ok = {p: [r for r in rs if "error" not in r] for p, rs in runs.items()}
    paths = {}
    for p, rs in ok.items():
        paths[p] = {m: med_range([r.get(m) for r in rs]) for m in METRICS}
        paths[p]["runs"] = len(rs)
        paths[p]["failed"] = len(runs[p]) - len(rs)
        paths[p]["unseen_shape_calls"] = [r.get("unseen_shape_calls") for r in rs]
        paths[p]["prompt_rows"] = rs[0]["prompt_rows"] if rs else None
    ratios = {}
    if "ours" in runs:
        base = {r["repeat"]: r for r in ok["ours"]}
        for p in runs:
            if p == "ours":
                continue
            mine = {r["repeat"]: r for r in ok[p]}
            reps = sorted(set(base) & set(mine))
            ratios[p] = {m: paired([mine[i][m] for i in reps], [base[i][m] for i in reps]) for m in RATIO_METRICS}
    return dict(tool="bench_tts", profile=args.profile, device=args.device, backend=args.backend,
                compile_ours=not args.no_compile, turns=args.turns, slots=args.slots, repeats=args.repeats,
                context_segments=args.context_segments, ref_seconds=args.ref_seconds, torch=torch.__version__,
                absent_on_this_device=absent_on_this_device(args.device), paths=paths,
                ratios_vs_ours=ratios, noise_rule=f"ratio reported only if every repeat's ratio is beyond "
                                                  f"max({NOISE_FLOOR}, spread of either side) on one side of 1")


def fmt(s: dict, digits: int = 0) -> str:
    if s["median"] is None:
        return "n/a"
    f = f"{{:.{digits}f}}"
    return f"{f.format(s['median'])} ({f.format(s['min'])}-{f.format(s['max'])})"


def print_table(out: dict) -> None:
    print(f"profile={out['profile']} device={out['device']} backend={out['backend']} turns={out['turns']} "
          f"slots={out['slots']} repeats={out['repeats']} torch={out['torch']}; median (min-max) over repeats, "
          f"each run its own process with a fresh inductor cache")
    if out["absent_on_this_device"]:
        print("absent on this device (GPU-only): " + "; ".join(out["absent_on_this_device"]))
    cols = [("ttfa_p50_ms", "TTFA p50 ms", 0), ("ttfa_max_ms", "TTFA max ms", 0), ("encode_max_ms", "encode max ms", 0),
            ("prefill_max_ms", "prefill max ms", 0), ("rtf_mean", "RTF", 2), ("gap_max_ms", "gap max ms", 0),
            ("compiles_after_warmup", "compiles", 0), ("warmup_s", "warm-up s", 1)]
    print("| path | runs | " + " | ".join(c[1] for c in cols) + " |")
    print("|---|---:|" + "---:|" * len(cols))
    for p, s in out["paths"].items():
        print(f"| {p} | {s['runs']} | " + " | ".join(fmt(s[k], d) for k, _, d in cols) + " |")
    for p, rs in out["ratios_vs_ours"].items():
        parts = []
        for m, r in rs.items():
            parts.append(f"{m} {r['median']}x" if r["median"] is not None else f"{m} within noise {r['ratios']}")
        print(f"{p}/ours (median of paired per-repeat ratios): " + "; ".join(parts))


FORWARD = ("profile", "device", "turns", "backend", "max_frames", "max_seq_len", "encode_buckets", "threads",
           "slots", "context_segments", "ref_seconds")


def child_argv(args) -> list[str]:
    argv = []
    for k in FORWARD:
        v = getattr(args, k)
        if v is None:
            continue
        argv.append("--" + k.replace("_", "-"))
        argv += [str(x) for x in v] if isinstance(v, (list, tuple)) else [str(v)]
    if args.no_compile:
        argv.append("--no-compile")
    return argv


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profile", choices=["tiny", "full"], default="tiny")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--backend", default="inductor")
    ap.add_argument("--no-compile", action="store_true", help="ours without torch.compile (eager)")
    ap.add_argument("--paths", nargs="+", choices=PATHS, default=list(PATHS))
    ap.add_argument("--no-naive", action="store_true", help="leave out the compiled_raw path (the former 'naive')")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--order-seed", type=int, default=0, help="seed of the per-repeat shuffle of the paths")
    ap.add_argument("--child-prefix", default="", help="command prefix of every child process, e.g. 'flock /tmp/x.lock'")
    ap.add_argument("--child-timeout", type=float, default=None, help="seconds per child process")
    ap.add_argument("--context-segments", type=int, default=4,
                    help="seed: the last N conversation segments (both sides) re-encoded every turn")
    ap.add_argument("--ref-seconds", type=float, nargs="*", default=[3.0, 2.0],
                    help="seed: reference clips (bot voice prompt) re-encoded every turn")
    ap.add_argument("--slots", type=int, default=1, help="engine slots (one conversation: 1)")
    ap.add_argument("--max-frames", type=int, default=None, help="cap frames per reply (full on CPU: 2)")
    ap.add_argument("--max-seq-len", type=int, default=None, help="KV cache rows (the largest prefill bucket)")
    ap.add_argument("--encode-buckets", type=int, nargs="+", default=None, help="frames of 80 ms")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--path", choices=PATHS, default=None, help="child mode: run this one path in this process")
    ap.add_argument("--json-out", default=None, help="child mode: write the result here")
    args = ap.parse_args(argv)
    if args.no_naive:
        args.paths = [p for p in args.paths if p != "compiled_raw"]
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.path is not None:  # a child: one path in this process
        write_result(run_path(args), args.json_out)
        return
    runs = run_children(list(dict.fromkeys(args.paths)), args.repeats, lambda _name: child_argv(args),
                        "load.bench_tts", shlex.split(args.child_prefix), args.order_seed, args.child_timeout,
                        label="bench_tts")
    out = report(args, runs)
    print_table(out)
    print(json.dumps(out))
    if any("error" in r for rs in runs.values() for r in rs):
        sys.exit(1)


if __name__ == "__main__":
    main()
