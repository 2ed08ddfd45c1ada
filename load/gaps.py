"""Gap test: hold a multi-turn conversation and fail if any reply has dead air.

    python -m load.gaps --turns 10 --max-gap-ms 500 --out out/gap
    python -m load.gaps --turns 10 --protocol realtime --process-cpu   # the OpenAI Realtime endpoint,
                                                                       # with the gateway's CPU per audio second

Turns alternate typed and spoken, each of a different length. Spoken turns come from WAV
files synthesized with espeak-ng when it is installed (`apt-get install espeak-ng`) or rendered
beforehand (load/speech.py, ``$GAPLESS_SPEECH_DIR``), else from
a speech-shaped synthetic signal. Records every gap between consecutive audio chunks of a
reply and each turn's time to first audio; prints a table and a JSON line, writes a JSON
report and a PNG timeline (gaps over the limit in red), and exits 1 if any gap exceeds
``--max-gap-ms`` (2 if the conversation itself failed).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

import numpy as np

from load import speech
from load.speech import SPOKEN
from load.client import Conversation, TurnResult, add_token_argument
from load.processes import ProcessCPU
from pipeline.audio import float_to_int16, int16_to_float, resample, speech_like
from pipeline.audio_constants import USER_RATE

TYPED = [
    "Hello!",
    "What time is it, please?",
    "Tell me a short story about a fox and a crow.",
    "Thanks, that was nice.",
    "Could you book a table for two people tomorrow evening at seven?",
    "Why is the sky blue?",
    "Okay.",
    "Please describe the weather in the mountains during a long summer afternoon.",
]


def spoken_audio(i: int, text: str) -> tuple[np.ndarray, str]:
    """16 kHz int16 audio for spoken turn ``i``: espeak-ng if present, else synthetic."""
    if speech.can_say(text):
        pcm, rate = speech.spoken(text)
        return float_to_int16(resample(int16_to_float(pcm), rate, USER_RATE)), "espeak-ng"
    return speech_like(0.8 + 0.4 * len(text.split()) / 3, seed=i), "synthetic"


PROTOCOLS = ("v1", "realtime")
URLS = {"v1": "ws://127.0.0.1:8000/v1/conversation", "realtime": "ws://127.0.0.1:8000/v1/realtime"}
# The same push-to-talk session on both: v1 without VAD or echo canceller, as Realtime with turn_detection null
PUSH_TO_TALK = {"v1": URLS["v1"] + "?turn_detection=manual&barge_in=off&vad_events=false",
                "realtime": URLS["realtime"]}


def client(protocol: str, url: str, token: str | None, audio_format: str = "pcm"):
    """A conversation client of either protocol, with one interface (load.client / load.realtime_client)."""
    if protocol == "realtime":
        from load.realtime_client import RealtimeConversation

        return RealtimeConversation(url, token=token, audio_format=audio_format)
    return Conversation(url, token=token)


async def converse(url: str, turns: int, realtime: bool, token: str | None = None, protocol: str = "v1",
                   audio_format: str = "pcm", agent: dict | None = None) -> tuple[list[dict], Conversation]:
    """``agent``: voice and language to set first (None: the server's defaults)."""
    rows = []
    # Synthesize every spoken turn before connecting: nothing may block the client's event loop
    # mid-conversation (it would miss the server's keepalive pings).
    spoken = {i: spoken_audio(i, SPOKEN[(i // 2) % len(SPOKEN)]) for i in range(1, turns, 2)}
    async with client(protocol, url, token, audio_format) as conv:
        if agent:
            await _set_agent(conv, protocol, agent)
        for i in range(turns):
            if i % 2 == 0:
                text = TYPED[(i // 2) % len(TYPED)]
                tr = await conv.say_text(text)
                kind, seconds = "typed", 0.0
            else:
                pcm, source = spoken[i]
                tr = await conv.say_audio(pcm, realtime=realtime)
                kind, seconds = f"spoken ({source})", len(pcm) / USER_RATE
            rows.append(turn_row(tr, kind, seconds))
            print(f"turn {tr.turn}: {kind}, {len(tr.chunks)} chunks", file=sys.stderr, flush=True)
    return rows, conv


async def _set_agent(conv, protocol: str, agent: dict) -> None:
    if protocol == "v1":
        answer = await conv.update(**agent)
    else:
        audio = {"output": {"voice": agent["voice"]}} if "voice" in agent else {}
        if "language" in agent:
            audio["input"] = {"transcription": {"language": agent["language"]}}
        answer = await conv.update({"audio": audio})
    if answer["type"] == "error":
        raise RuntimeError(f"the session refused {agent}: {answer.get('message') or answer.get('error')}")


def turn_row(tr: TurnResult, kind: str, input_s: float) -> dict:
    t0 = tr.ended_at
    return {
        "turn": tr.turn,
        "kind": kind,
        "input_s": round(input_s, 3),
        "transcript": tr.final_text,
        "reply": tr.response_text,
        "chunks": len(tr.chunks),
        "audio_s": round(tr.audio_s, 3),
        "ttfa_s": None if tr.time_to_first_audio is None else round(tr.time_to_first_audio, 4),
        "gaps_s": [round(g, 4) for g in tr.gaps],
        "chunk_times_s": [round(t - t0, 4) for t in tr.chunk_times],
        "chunk_seconds": [round(len(c) / tr.output_rate, 4) for c in tr.chunks],
        "interrupted": tr.interrupted,
        "server_timings_ms": tr.timings,
    }


def summarize(rows: list[dict], max_gap_s: float) -> dict:
    gaps = np.array([g for r in rows for g in r["gaps_s"]] or [0.0])
    ttfa = np.array([r["ttfa_s"] for r in rows if r["ttfa_s"] is not None] or [np.nan])
    return {
        "turns": len(rows),
        "chunks": int(sum(r["chunks"] for r in rows)),
        "gap_p50_ms": round(float(np.percentile(gaps, 50)) * 1000, 1),
        "gap_p99_ms": round(float(np.percentile(gaps, 99)) * 1000, 1),
        "gap_max_ms": round(float(gaps.max()) * 1000, 1),
        "gaps_over_limit": int((gaps > max_gap_s).sum()),
        "ttfa_p50_ms": round(float(np.nanpercentile(ttfa, 50)) * 1000, 1),
        "ttfa_p95_ms": round(float(np.nanpercentile(ttfa, 95)) * 1000, 1),
        "turns_without_audio": sum(1 for r in rows if r["chunks"] == 0),
        # where time to first audio goes, ms after transcript.final (server side), p50 over turns
        **{f"{k}_p50": round(float(np.median(v)), 1) for k, v in _timings(rows).items()},
        "max_gap_ms_limit": max_gap_s * 1000,
    }


def _timings(rows: list[dict]) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {}
    for r in rows:
        for k, v in (r["server_timings_ms"] or {}).items():
            out.setdefault(k, []).append(v)
    return out


def print_table(rows: list[dict]) -> None:
    print(f"{'turn':>4} {'kind':<20} {'in s':>5} {'chunks':>6} {'audio s':>7} {'ttfa ms':>8} {'gap p50':>8} "
          f"{'gap max':>8} {'llm 1st':>8} {'clause':>7} {'audio':>6}")
    for r in rows:
        g = r["gaps_s"] or [0.0]
        ttfa = "-" if r["ttfa_s"] is None else f"{r['ttfa_s'] * 1000:.0f}"
        t = r["server_timings_ms"] or {}
        split = " ".join(f"{t.get(k, float('nan')):>{w}.0f}" for k, w in
                         (("llm_first_token_ms", 8), ("first_clause_ms", 7), ("first_audio_ms", 6)))
        print(f"{r['turn']:>4} {r['kind']:<20} {r['input_s']:>5.2f} {r['chunks']:>6} {r['audio_s']:>7.2f} "
              f"{ttfa:>8} {np.median(g) * 1000:>8.0f} {max(g) * 1000:>8.0f} {split}")
    print("(llm 1st / clause / audio: server-side ms after transcript.final to the LLM's first token, "
          "the first clause handed to TTS, the first audio chunk sent)")


def draw_timeline(rows: list[dict], max_gap_s: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(11, 0.5 * len(rows) + 1.5))
    for r in rows:
        y = r["turn"]
        times = r["chunk_times_s"]
        for t, dur in zip(times, r["chunk_seconds"]):
            ax.barh(y, dur, left=t, height=0.5, color="tab:blue", alpha=0.6)
        for a, b in zip(times, times[1:]):
            if b - a > max_gap_s:
                ax.plot([a, b], [y, y], color="red", linewidth=3)
        if r["ttfa_s"] is not None:
            ax.plot([0, r["ttfa_s"]], [y, y], color="gray", linestyle=":")
    ax.set_xlabel("seconds since the end of the user turn (bars: audio chunks as sent, length = audio duration)")
    ax.set_ylabel("turn")
    ax.set_yticks([r["turn"] for r in rows])
    ax.invert_yaxis()
    ax.set_title(f"reply audio timeline; red = gap over {max_gap_s * 1000:.0f} ms")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--protocol", choices=PROTOCOLS, default="v1",
                    help="v1 (msgpack, /v1/conversation) or realtime (the OpenAI Realtime protocol through the "
                         "official openai SDK, /v1/realtime)")
    ap.add_argument("--url", default=None, help="default: the protocol's endpoint on 127.0.0.1:8000")
    ap.add_argument("--audio-format", choices=("pcm", "pcmu", "pcma"), default="pcm",
                    help="realtime only: the session's audio format both ways")
    ap.add_argument("--process-cpu", action="store_true",
                    help="report the CPU seconds the gateway and the HTTP proxy spent per second of reply audio "
                         "(server processes on this machine, read with psutil)")
    ap.add_argument("--turns", type=int, default=10)
    add_token_argument(ap)
    ap.add_argument("--max-gap-ms", type=float, default=500)
    ap.add_argument("--realtime", action="store_true", help="send spoken audio at real-time pace")
    ap.add_argument("--voice", default=None, help="the session's voice (default: the server's)")
    ap.add_argument("--language", default=None, help="the session's language, e.g. fr (default: the server's)")
    ap.add_argument("--out", default="out/gap", help="prefix of the JSON report and PNG timeline")
    args = ap.parse_args(argv)
    agent = {k: v for k, v in (("voice", args.voice), ("language", args.language)) if v is not None}
    max_gap_s = args.max_gap_ms / 1000
    url = args.url or URLS[args.protocol]
    meter = ProcessCPU() if args.process_cpu else None
    try:
        rows, conv = asyncio.run(converse(url, args.turns, args.realtime, args.token, args.protocol,
                                          args.audio_format, agent))
    except Exception as exc:  # noqa: BLE001 - report and fail
        print(f"conversation failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    summary = {"protocol": args.protocol, **agent, **summarize(rows, max_gap_s)}
    if meter is not None:
        audio_s = sum(r["audio_s"] for r in rows)
        summary.update({f"{name}_cpu_ms_per_audio_s": round(1000 * cpu / audio_s, 2)
                        for name, cpu in meter.spent().items()})
    summary["errors"] = [e["code"] for e in conv.errors]
    print_table(rows)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({"summary": summary, "turns": rows}, indent=1))
    draw_timeline(rows, max_gap_s, out.with_suffix(".png"))
    print(json.dumps(summary))
    failed = summary["gaps_over_limit"] > 0 or summary["errors"] or summary["turns_without_audio"]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
