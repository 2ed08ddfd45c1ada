"""The WebRTC benchmark: voice-to-voice over WebRTC against the WebSocket path in the same run,
and N WebRTC calls at once (dead air inside replies as the caller receives them, and the
gateway's CPU per call: Opus decode and encode, the peer connections, the sessions).

    .venv/bin/python -m load.webrtc --rounds 6 --calls 1,2,4 --seconds 30   # against serve run serve_config.yaml

Voice-to-voice is measured from the true end of speech (the last frame of speech the microphone
sent) to the first reply audio received: over WebRTC the first loud frame the reply track
delivers (after Opus and aiortc's jitter buffer), over the WebSocket the first audio message of
protocol v1 (load/client.py, as load.turn_taking measures it). Each round runs both, in random
order, on fresh connections, with the same sentence; the table shows medians, ranges and the
paired ratio. Prints a table and one JSON line.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time

import numpy as np

from load import speech
from load.client import Conversation, add_token_argument
from load.processes import ProcessCPU
from load.webrtc_client import RtcCall

SENTENCES = ["What time does the museum open tomorrow?", "Can you book a table for two people tonight?",
             "Tell me a short story about a lighthouse.", "How far is the station from here?"]
BASE = "http://127.0.0.1:8000"
WS_URL = "ws://127.0.0.1:8000/v1/conversation"
SHORT = {"max_output_tokens": 24}  # every load tool's reply length on CPU


async def webrtc_v2v(base: str, pcm: np.ndarray, token: str | None = None) -> float:
    async with RtcCall(base, credential=token, session=SHORT) as call:
        await call.wait(lambda c: c.of("session.created"))
        await call.say(speech.padded(pcm, 0.3, 2.0), speech_end=int(0.3 * 16_000) + len(pcm))
        await call.wait(lambda c: c.mic.speech_ended_at is not None and c.loud_after(c.mic.speech_ended_at), 60)
        return 1000 * (call.loud_after(call.mic.speech_ended_at)[0] - call.mic.speech_ended_at)


async def websocket_v2v(url: str, pcm: np.ndarray, token: str | None = None) -> float:
    async with Conversation(url, token=token) as conv:
        clip = speech.padded(pcm, 0.3, 0.0)
        turn = await conv.say_hands_free(clip, speech_end=len(clip))
        return 1000 * turn.time_to_first_audio


async def one_call(base: str, seconds: float, clips: list[np.ndarray], token: str | None = None) -> dict:
    """Speaks sentences for ``seconds``, each after the previous reply was received; the dead air
    inside each reply: gaps between its loud frames, from its first to its response.done."""
    gaps: list[float] = []
    turns = 0
    async with RtcCall(base, credential=token, session=SHORT) as call:
        await call.wait(lambda c: c.of("session.created"))
        ends = time.monotonic() + seconds
        while time.monotonic() < ends:
            done = len(call.of("response.done"))
            await call.say(speech.padded(clips[turns % len(clips)], 0.3, 1.5))
            await call.wait(lambda c: len(c.of("response.done")) > done, 60)
            done_at = max(t for t, e in zip(call.event_times, call.events) if e["type"] == "response.done")
            loud = [t for t in call.loud_after(call.mic.speech_ended_at or 0) if t <= done_at]
            gaps += [b - a - 0.02 for a, b in zip(loud, loud[1:])]
            turns += 1
            await asyncio.sleep(1.0)  # the reply plays out
    return {"turns": turns, "gaps": gaps}


def _pct(xs: list[float], q: float) -> float | None:
    return float(np.percentile(xs, q)) if xs else None


async def main_async(args) -> dict:
    clips = [speech.espeak(s) for s in SENTENCES]
    rows = []
    for r in range(args.rounds):
        pcm = clips[r % len(clips)]
        order = random.sample(["webrtc", "websocket"], 2)
        row = {}
        for path in order:
            row[path] = await (webrtc_v2v(args.base, pcm, args.token) if path == "webrtc"
                               else websocket_v2v(args.ws, pcm, args.token))
        rows.append(row)
    levels = []
    for n in args.calls:
        cpu = ProcessCPU(("gateway",))
        t0 = time.monotonic()
        results = await asyncio.gather(*(one_call(args.base, args.seconds, clips, args.token) for _ in range(n)))
        wall = time.monotonic() - t0
        gaps = [g for res in results for g in res["gaps"]]
        levels.append({"calls": n, "turns": sum(res["turns"] for res in results),
                       "gap_p50_ms": 1000 * (_pct(gaps, 50) or 0), "gap_p99_ms": 1000 * (_pct(gaps, 99) or 0),
                       "gap_max_ms": 1000 * max(gaps, default=0), "gaps_over_500ms": sum(g > 0.5 for g in gaps),
                       "gateway_cpu_s_per_call_s": cpu.spent()["gateway"] / (n * wall)})
    webrtc, ws = [r["webrtc"] for r in rows], [r["websocket"] for r in rows]
    ratios = [r["webrtc"] / r["websocket"] for r in rows]
    return {"rounds": len(rows), "v2v_ms": {
        "webrtc": {"p50": statistics.median(webrtc), "min": min(webrtc), "max": max(webrtc)},
        "websocket": {"p50": statistics.median(ws), "min": min(ws), "max": max(ws)},
        "ratio_webrtc_over_websocket": {"p50": statistics.median(ratios), "min": min(ratios), "max": max(ratios)}},
        "levels": levels}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", default=BASE)
    ap.add_argument("--ws", default=WS_URL)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--calls", default="1,2,4", type=lambda v: [int(x) for x in v.split(",")])
    ap.add_argument("--seconds", type=float, default=30.0)
    add_token_argument(ap)
    args = ap.parse_args(argv)
    res = asyncio.run(main_async(args))
    v = res["v2v_ms"]
    print(f"voice-to-voice over {res['rounds']} paired rounds (ms, median [min-max]):")
    for path in ("webrtc", "websocket"):
        print(f"  {path:<10} {v[path]['p50']:6.0f} [{v[path]['min']:.0f}-{v[path]['max']:.0f}]")
    r = v["ratio_webrtc_over_websocket"]
    print(f"  ratio webrtc/websocket {r['p50']:.2f} [{r['min']:.2f}-{r['max']:.2f}]")
    print("| calls | turns | dead air p50 / p99 / max (ms) | over 500 ms | gateway CPU-s per call-s |")
    print("|---|---|---|---|---|")
    for lv in res["levels"]:
        print(f"| {lv['calls']} | {lv['turns']} | {lv['gap_p50_ms']:.0f} / {lv['gap_p99_ms']:.0f} / "
              f"{lv['gap_max_ms']:.0f} | {lv['gaps_over_500ms']} | {lv['gateway_cpu_s_per_call_s']:.3f} |")
    print(json.dumps(res))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
