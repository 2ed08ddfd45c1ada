"""First audio of a reply, the two TTS families side by side, in one process (services as served).

    python -m load.bench_first_audio --rounds 5                 # tiny, CPU
    python -m load.bench_first_audio --profile full --device cuda

The same three-clause reply, spoken by each arm, in an order shuffled every round:

csm
    CSM (``TTSEngine``), a stream per clause, each after the one before (as the conversation
    hands it clauses), no context.
dsm_clauses
    DSM (``DSMEngine``), a stream per clause the same way (how it was served before one
    utterance per reply).
dsm_utterance
    DSM, one utterance fed the clauses (``TTSService.open``/``feed``), as the conversation feeds it.

Per arm: the time from the first clause handed to the TTS to its first chunk (``first``), and to
the whole reply's audio made (``made``, of ``audio`` seconds: random weights speak the same text
for different lengths, so ``made`` compares across arms of one family only); median and range over the rounds, and each DSM arm's
paired per-round ratio to CSM (reported only above noise, :func:`load.isolated_runs.paired`).
Prints a table and one JSON line. Each engine gets one torch thread (``--threads``).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import time

import torch

from load.isolated_runs import med_range, paired
from pipeline.runtime.threads import InferenceThread
from pipeline.services import TTSService, load_tts
from pipeline.tts.config import TTSConfig

CLAUSES = ["Hello there, my friend.", "How are you today?", "I am fine, thank you, and the sea is calm."]


async def _per_clause(svc: TTSService) -> tuple[float, float, float]:
    t0 = time.perf_counter()
    first, samples = None, 0
    for clause in CLAUSES:
        async for pcm, _ in svc.stream(clause, []):
            first = first if first is not None else time.perf_counter() - t0
            samples += len(pcm)
    return first, time.perf_counter() - t0, samples / svc.engine.sample_rate


async def _utterance(svc: TTSService, uid: str) -> tuple[float, float, float]:
    t0 = time.perf_counter()
    await svc.open(uid)
    first, new, samples = None, list(CLAUSES), 0
    while True:
        fed = await svc.feed(uid, new, final=bool(new))
        new = []
        if fed.chunks and first is None:
            first = time.perf_counter() - t0
        samples += sum(len(pcm) for _, pcm, _ in fed.chunks)
        if fed.ended:
            return first, time.perf_counter() - t0, samples / svc.engine.sample_rate


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--profile", default="tiny")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    services = {}
    for family in ("csm", "dsm"):
        thread = InferenceThread(f"tts-{family}", args.threads)
        cfg = getattr(TTSConfig, args.profile)(family=family, device=args.device, num_slots=4)
        services[family] = (thread, cfg)
    arms = {"csm": lambda s, r: _per_clause(s["csm"]), "dsm_clauses": lambda s, r: _per_clause(s["dsm"]),
            "dsm_utterance": lambda s, r: _utterance(s["dsm"], f"bench-{r}")}
    engines = {f: thread.call(load_tts, cfg) for f, (thread, cfg) in services.items()}
    rng = random.Random(args.seed)
    runs: dict[str, dict[str, list[float]]] = {a: {"first": [], "made": [], "audio": []} for a in arms}

    async def rounds():
        svcs = {f: TTSService(engines[f], services[f][0]) for f in engines}
        for arm in arms:  # once each, unrecorded: every path warm
            await arms[arm](svcs, -1 - len(arm))
        for r in range(args.rounds):
            order = list(arms)
            rng.shuffle(order)
            for arm in order:
                first, made, audio = await arms[arm](svcs, r)
                runs[arm]["first"].append(first * 1000)
                runs[arm]["made"].append(made * 1000)
                runs[arm]["audio"].append(audio)

    asyncio.run(rounds())
    result = {"profile": args.profile, "device": args.device, "rounds": args.rounds, "clauses": len(CLAUSES),
              "arms": {a: {k: med_range(v) for k, v in m.items()} for a, m in runs.items()},
              "vs_csm": {a: {k: paired(runs[a][k], runs["csm"][k]) for k in ("first", "made")}
                         for a in ("dsm_clauses", "dsm_utterance")}}
    print(f"{'arm':15} {'first ms (median [min-max])':>30} {'made ms (median [min-max])':>30} {'audio s':>8} "
          f"{'first / csm':>12}")
    for a, m in result["arms"].items():
        cell = lambda d: f"{d['median']:.0f} [{d['min']:.0f}-{d['max']:.0f}]"  # noqa: E731
        ratio = result["vs_csm"].get(a, {}).get("first", {})
        shown = "-" if a == "csm" else (f"{ratio['median']:.2f}" if ratio.get("median") else f"~ ({ratio['ratios']})")
        print(f"{a:15} {cell(m['first']):>30} {cell(m['made']):>30} {m['audio']['median']:>8.2f} {shown:>12}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
