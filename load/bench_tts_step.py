"""The CSM frame step alone: eager vs CUDA graphs vs torch.compile, same weights, same inputs.

    python -m load.bench_tts_step --profile full --device cuda --widths 1,8,32           # eager vs graphs
    python -m load.bench_tts_step --profile full --device cuda --widths 8 --compiled     # + torch.compile
    python -m load.bench_tts_step --widths 1,4,8 --compiled                              # tiny, CPU

The step is what :meth:`TTSEngine.step` runs per 80 ms frame for W streams (backbone step, codebook 0,
31 depth steps, sampling), on cache rows at positions spread over the prompt range, sampled at
temperature 0.9 with the engine's noise. Modes, each over the same inputs:

- ``eager``: the engine's default;
- ``graphs``: :class:`pipeline.tts.cuda_graphs.GraphedFunction` (CUDA only), what ``tts.frame_graphs``
  serves;
- ``compiled`` (``--compiled``): ``torch.compile`` with the engine's settings (``reduce-overhead``,
  i.e. inductor plus CUDA graphs, on CUDA; inductor's default on CPU). Its compile time is reported.

Every mode's codes are compared with eager's for the same inputs (``codes_equal``: the fraction of
rows whose 32 codes are all equal). Per round, in random order, each (mode, width) runs ``--steps``
steps after one untimed step; reported per width: median [min-max] ms per step over rounds and the
paired ratio eager/mode per round. Prints a table and one JSON line.
"""
from __future__ import annotations

import argparse
import json
import random
import time

import torch

from load.bench_tts_batch import summary
from pipeline.runtime.threads import keep_large_allocations, pin_torch_threads
from pipeline.tts.config import TTSConfig
from pipeline.tts.cuda_graphs import GraphedFunction
from pipeline.tts.engine import TTSEngine
from pipeline.tts.sampling import race_noise, race_width


def step_inputs(engine: TTSEngine, width: int, seed: int) -> tuple:
    """Frame-step inputs for ``width`` continuing rows at positions spread over the cache."""
    g = torch.Generator().manual_seed(seed)
    csm, dev = engine.csm, engine.device
    dim, k = csm.arch.backbone.dim, csm.arch.num_codebooks
    dtype = next(csm.parameters()).dtype
    h0 = torch.randn(width, dim, generator=g).to(device=dev, dtype=dtype)
    first = torch.zeros(width, dtype=torch.bool, device=dev)
    codes = torch.randint(0, csm.n_valid, (width, k), generator=g).to(dev)
    pos = torch.randint(16, engine.cfg.max_seq_len - engine.cfg.max_frames, (width,), generator=g).to(dev)
    seeds = torch.arange(width, device=dev, dtype=torch.long) + seed
    noise = race_noise(seeds, torch.zeros_like(seeds), k, race_width(engine.cfg.top_k, csm.n_valid))
    temperature = torch.full((width,), 0.9, device=dev)
    return h0, first, codes, pos, noise, temperature


def sync(engine: TTSEngine) -> None:
    if engine.device.type == "cuda":
        torch.cuda.synchronize()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profile", default="tiny", choices=["tiny", "full"])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--widths", default="1,4,8")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--compiled", action="store_true", help="also torch.compile (minutes per width on a CPU)")
    args = ap.parse_args()
    pin_torch_threads(args.threads)
    keep_large_allocations()
    widths = [int(w) for w in args.widths.split(",")]
    make = {"tiny": TTSConfig.tiny, "full": TTSConfig.full}[args.profile]
    engine = TTSEngine(make(device=args.device, num_slots=max(widths), batch_widths=tuple(widths)))
    top_k = engine.cfg.top_k

    def frame(*a):
        return engine.csm.frame_fn(*a, top_k)

    modes: dict[str, object] = {"eager": frame}
    if engine.device.type == "cuda":
        modes["graphs"] = GraphedFunction(frame)
    prepare_s: dict[str, dict[int, float]] = {m: {} for m in modes}
    if args.compiled:
        mode = "reduce-overhead" if engine.device.type == "cuda" else None
        compiled = torch.compile(frame, dynamic=False, fullgraph=True, mode=mode)
        modes["compiled"] = compiled if mode is None else (
            lambda *a: (torch.compiler.cudagraph_mark_step_begin(), compiled(*a))[1].clone())
        prepare_s["compiled"] = {}
    inputs = {w: step_inputs(engine, w, seed=w) for w in widths}
    reference: dict[int, torch.Tensor] = {}
    equal: dict[str, dict[int, float]] = {m: {} for m in modes}
    for name, fn in modes.items():  # first calls: capture / compile (timed), and the codes vs eager
        for w in widths:
            sync(engine)
            t0 = time.perf_counter()
            out = fn(*inputs[w])
            sync(engine)
            prepare_s[name][w] = time.perf_counter() - t0
            out = fn(*inputs[w]).cpu()
            reference.setdefault(w, out)
            equal[name][w] = (out == reference[w]).all(dim=1).float().mean().item()
            print(f"{name} width {w}: first call {prepare_s[name][w]:.1f} s, codes equal to eager "
                  f"{equal[name][w]:.2f}", flush=True)

    rng = random.Random(0)
    ms: dict[str, dict[int, list[float]]] = {m: {w: [] for w in widths} for m in modes}
    for _ in range(args.rounds):
        jobs = [(m, w) for m in modes for w in widths]
        rng.shuffle(jobs)
        for name, w in jobs:
            fn, x = modes[name], inputs[w]
            fn(*x)
            sync(engine)
            t0 = time.perf_counter()
            for _ in range(args.steps):
                fn(*x)
            sync(engine)
            ms[name][w].append(1000 * (time.perf_counter() - t0) / args.steps)

    print(f"CSM frame step: profile={args.profile} device={args.device} threads={args.threads} "
          f"steps={args.steps} rounds={args.rounds} (ms per step, median [min-max]; ratio = eager / mode, paired)")
    out: dict = {}
    for w in widths:
        row = []
        for name in modes:
            s = summary(ms[name][w])
            ratio = summary([e / m for e, m in zip(ms["eager"][w], ms[name][w])])
            out.setdefault(w, {})[name] = {"ms": s, "ratio": ratio, "codes_equal": equal[name][w],
                                           "first_call_s": prepare_s[name][w]}
            row.append(f"{name} {s['median']:.2f} [{s['min']:.2f}-{s['max']:.2f}] x{ratio['median']:.2f}")
        print(f"width {w:>3} | " + " | ".join(row))
    print(json.dumps({"bench": "tts_step", "profile": args.profile, "device": args.device, "threads": args.threads,
                      "steps": args.steps, "rounds": args.rounds, "widths": out}))


if __name__ == "__main__":
    with torch.inference_mode():
        main()
