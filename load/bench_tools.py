"""What a forced tool call costs, with and without its constraint, and how soon a tool's result is
heard.

    python -m load.bench_tools --rounds 5 --calls 8
    python -m load.bench_tools --profile full --device cuda     # the full-shape LLM (GPU)

Per round, in a random order, the same forced calls (``tool_choice`` naming each of four tools in
turn, with different seeds) run on one engine:

- **constrained**: the served path, llguidance masking each step (``pipeline/llm/constraint.py``);
- **unconstrained**: the same prompt and as many tokens, no mask (what the constraint adds).

Measured: ms per generated token; ms from the stream's start to the first token of the
arguments (constrained: the token after ``"arguments":``; unconstrained: the token at the same
position); the share of calls whose arguments validate (jsonschema). Then, on the in-process
engines (tiny profile only), a v1 session's ms from sending ``tool.result`` to the first audio of
the reply that uses it. Prints a table (median and range over rounds, paired ratios) and a JSON line.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time

import jsonschema
import numpy as np

TOOLS = [
    {"type": "function", "name": "book_table", "description": "Book a table.", "parameters": {
        "type": "object", "required": ["party", "day"], "properties": {
            "party": {"type": "integer", "minimum": 1, "maximum": 12},
            "day": {"type": "string", "enum": ["mon", "tue", "wed", "thu", "fri"]}}}},
    {"type": "function", "name": "set_mood", "description": "Set the lights.", "parameters": {
        "type": "object", "required": ["mood"], "properties": {"mood": {"enum": ["calm", "party", "focus"]}}}},
    {"type": "function", "name": "add_items", "description": "Add to the list.", "parameters": {
        "type": "object", "required": ["items"], "properties": {"items": {
            "type": "array", "minItems": 1, "maxItems": 3, "items": {"type": "string", "maxLength": 12}}}}},
    {"type": "function", "name": "set_thermostat", "description": "Set the heating.", "parameters": {
        "type": "object", "required": ["celsius"], "properties": {"celsius": {"type": "number", "minimum": 15,
                                                                              "maximum": 24}}}},
]
ASK = [{"role": "user", "content": "Please do it now."}]
ARGS_MARK = '"arguments":'


def run_calls(engine, n: int, constrained: bool, reference: dict | None = None) -> dict:
    """``n`` forced calls. Unconstrained runs generate the ``reference`` (constrained) run's token
    counts, and take their first-argument time at the position where its arguments began."""
    from pipeline.engines import Sampling
    from pipeline.llm.tool_calls import ToolCallParser

    per_token, first_arg, first_arg_index, valid, generated = [], [], [], 0, []
    for i in range(n):
        tool = TOOLS[i % len(TOOLS)]
        if constrained:
            sampling = Sampling(tools=tuple(TOOLS), tool_choice={"type": "function", "name": tool["name"]})
        else:
            sampling = Sampling(tools=tuple(TOOLS), max_output_tokens=reference["tokens"][i])
        t0 = time.perf_counter()
        stream = engine.stream(ASK, sampling, seed=1000 + i)
        text, times = "", []
        for delta in stream:
            text += delta
            times.append(time.perf_counter())
            if constrained and not first_arg_index[i:] and ARGS_MARK in text:
                first_arg_index.append(len(times))  # the next delta holds the first argument token
        elapsed = time.perf_counter() - t0
        generated.append(len(stream.generated))
        per_token.append(1000 * elapsed / max(1, len(stream.generated)))
        k = first_arg_index[i] if constrained else reference["first_arg_index"][i]
        first_arg.append(1000 * (times[min(k, len(times) - 1)] - t0))
        parser = ToolCallParser()
        calls = [c for c in parser.push(text) + parser.flush() if not isinstance(c, str)]
        if calls and calls[0].name == tool["name"]:
            try:
                jsonschema.validate(json.loads(calls[0].arguments), tool["parameters"])
                valid += 1
            except (ValueError, jsonschema.ValidationError):
                pass
    return {"ms_per_token": float(np.median(per_token)), "ms_to_first_argument": float(np.median(first_arg)),
            "valid_share": valid / n, "tokens": generated, "first_arg_index": first_arg_index}


def result_to_audio(turns: int) -> list[float]:
    """ms from a v1 tool.result to the first audio of the reply that uses it (in-process, tiny)."""
    from pipeline.adapters.v1 import protocol as P
    from pipeline.llm.config import LLMConfig
    from pipeline.services import LocalBackends
    from pipeline.adapters.v1.adapter import Session
    from pipeline.session_config import SessionConfig
    from pipeline.stt.config import STTConfig
    from pipeline.tts.config import TTSConfig

    backends = LocalBackends.build(STTConfig.tiny(num_slots=1, endpoint_ms=None), LLMConfig.tiny(), TTSConfig.tiny())

    async def go() -> list[float]:
        arrived: asyncio.Queue = asyncio.Queue()

        async def send(frame):
            arrived.put_nowait((time.perf_counter(), P.unpack(frame)))

        async def until(kind):
            while True:
                at, msg = await arrived.get()
                if msg["type"] == kind:
                    return at, msg

        s = Session(send, backends, SessionConfig(turn_detection="manual", pace_lead_s=None))
        await s.start()
        await s.on_frame(P.pack({"type": "session.update", "tools": TOOLS[:1], "tool_choice": "required"}))
        out = []
        for i in range(turns):
            await s.on_frame(P.client_text("Book a table for two on Friday."))
            _, call = await until("tool.call")
            sent = time.perf_counter()
            await s.on_frame(P.pack({"type": "tool.result", "call_id": call["call_id"], "output": "Booked."}))
            at, _ = await until("audio")
            out.append(1000 * (at - sent))
            await until("response.done")
        await s.close()
        return out

    return asyncio.run(go())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--calls", type=int, default=8, help="forced calls per path and round")
    ap.add_argument("--profile", choices=("tiny", "full"), default="tiny")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--result-turns", type=int, default=5, help="tool.result -> first audio samples (tiny only)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    import torch

    from pipeline.llm import make_llm
    from pipeline.llm.config import LLMConfig

    torch.set_num_threads(1)
    cfg = (LLMConfig.tiny if args.profile == "tiny" else LLMConfig.full)(max_context_tokens=2048, device=args.device)
    engine = make_llm(cfg)
    engine.warmup()
    rng = random.Random(args.seed)
    rounds: dict[str, list[dict]] = {"constrained": [], "unconstrained": []}
    for r in range(args.rounds):
        # an untimed constrained run fixes each call's length and argument position; the timed order is shuffled
        reference = run_calls(engine, args.calls, True)
        order = ["constrained", "unconstrained"]
        rng.shuffle(order)
        for path in order:
            rounds[path].append(run_calls(engine, args.calls, path == "constrained", reference))
        print(f"round {r + 1}: " + ", ".join(f"{p} {rounds[p][-1]['ms_per_token']:.2f} ms/token" for p in order),
              file=sys.stderr, flush=True)
    table = {}
    print(f"{'measure':<24} {'constrained median [range]':>28} {'unconstrained median [range]':>30} {'ratio':>7}")
    for field in ("ms_per_token", "ms_to_first_argument", "valid_share"):
        row = {p: [run[field] for run in rounds[p]] for p in rounds}
        ratios = [c / u for c, u in zip(row["constrained"], row["unconstrained"]) if u]
        table[field] = {p: {"median": float(np.median(v)), "min": min(v), "max": max(v)} for p, v in row.items()}
        table[field]["ratio_median"] = round(float(np.median(ratios)), 3) if ratios else None
        cell = lambda p: f"{np.median(row[p]):.3f} [{min(row[p]):.3f}-{max(row[p]):.3f}]"  # noqa: E731
        print(f"{field:<24} {cell('constrained'):>28} {cell('unconstrained'):>30} {table[field]['ratio_median']!s:>7}")
    summary = {"profile": args.profile, "device": args.device, "rounds": args.rounds, "calls": args.calls,
               "table": table}
    if args.profile == "tiny" and args.result_turns:
        samples = result_to_audio(args.result_turns)
        summary["result_to_first_audio_ms"] = {"median": float(np.median(samples)), "min": min(samples),
                                               "max": max(samples), "n": len(samples)}
        print(f"tool.result -> first audio: median {np.median(samples):.1f} ms [{min(samples):.1f}-{max(samples):.1f}]"
              f" over {len(samples)} turns (v1 session, in-process)")
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
