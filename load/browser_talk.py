"""A conversation through the web client in real Chromium, measured by the page itself.

    python -m load.browser_talk [--url http://127.0.0.1:8000/] [--spoken 2] [--typed 2] [--jitter-ms 120]

The fake microphone says ``--spoken`` sentences hands-free (the server's VAD and Smart Turn end
each turn), far enough apart that each reply plays out first; then ``--typed`` turns follow,
each once the one before has played out. Per turn, from the end of the user's turn as the page
saw it (hands-free: the server's speech.stopped arrived; typed: the page sent the text): time
to first audio arrived and first audio played (after the jitter buffer), the largest gap
between arrivals, and the playback worklet's underruns. Prints a table and one JSON line.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import numpy as np

from load import browser, speech
from load.client import add_token_argument
from pipeline.audio_constants import REPLY_RATE, USER_RATE

SENTENCES = ["I would like to book a flight to Paris on Friday.", "Can you tell me about the weather tomorrow?",
             "Please play some relaxing music for me.", "What is the capital city of France?"]
TYPED = ["Tell me a short story.", "Thank you, that is all.", "What time is it?", "Goodbye for now."]
SPACING_S = 16.0  # one sentence every this long: a tiny-profile reply (~10 s of audio) plays out first


def mic_audio(n: int) -> np.ndarray:
    parts = [speech.silence(1.0)]
    for text in SENTENCES[:n]:
        clip = speech.espeak(text)
        parts += [clip, speech.silence(SPACING_S - len(clip) / USER_RATE)]
    return np.concatenate(parts)


def converse(url: str, spoken: int, typed: int, jitter_ms: float, token: str | None, screenshot: Path | None) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        wav = browser.write_mic_wav(Path(tmp) / "mic.wav", mic_audio(spoken)) if spoken else None
        mode = "vad" if spoken else "manual"
        with browser.Page(f"{url}?jitter_ms={jitter_ms:g}&mode={mode}&transport=websocket", wav) as page:
            page.connect(token=token)
            state = page.state()
            if not state["status"].startswith("connected"):
                raise RuntimeError(f"the page did not connect: {state['status']}")
            for turn in range(1, spoken + 1):
                page.wait_turn_done(turn, timeout_s=SPACING_S + 30)
            for i in range(typed):
                page.wait("g.playback.buffered === 0", 60)
                page.type_turn(TYPED[i % len(TYPED)])
                page.wait_turn_done(spoken + i + 1, timeout_s=60)
            page.wait("g.playback.buffered === 0", 60)
            state = page.state()
            if screenshot:
                page.screenshot(screenshot)
    return state


def rows_of(state: dict, spoken: int) -> list[dict]:
    rows = []
    for key in sorted(state["turns"], key=int):
        t = state["turns"][key]
        rows.append({"turn": t["turn"], "kind": "spoken" if t["turn"] <= spoken else "typed",
                     "first_audio_arrived_ms": t["firstChunkMs"], "first_audio_played_ms": t["firstPlayedMs"],
                     "largest_gap_ms": t["largestGapMs"], "chunks": t["chunks"], "underruns": t["underruns"],
                     "interrupted": t["interrupted"]})
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default="http://127.0.0.1:8000/")
    ap.add_argument("--spoken", type=int, default=2, choices=range(0, len(SENTENCES) + 1))
    ap.add_argument("--typed", type=int, default=2)
    ap.add_argument("--jitter-ms", type=float, default=120)
    add_token_argument(ap)  # the page asks for a ticket with it, where auth is on
    ap.add_argument("--screenshot", type=Path, default=Path("out/browser_talk.png"))
    args = ap.parse_args(argv)
    state = converse(args.url, args.spoken, args.typed, args.jitter_ms, args.token, args.screenshot)
    rows = rows_of(state, args.spoken)
    print(f"{'turn':>4} {'kind':>6} {'arrived':>9} {'played':>9} {'max gap':>9} {'chunks':>6} {'underruns':>9}")
    for r in rows:
        print(f"{r['turn']:>4} {r['kind']:>6} {r['first_audio_arrived_ms'] or 0:>7.0f}ms {r['first_audio_played_ms'] or 0:>7.0f}ms "
              f"{r['largest_gap_ms']:>7.0f}ms {r['chunks']:>6} {r['underruns']:>9}"
              f"{'  interrupted' if r['interrupted'] else ''}")
    played = [r["first_audio_played_ms"] for r in rows if r["first_audio_played_ms"] is not None]
    summary = {"tool": "browser_talk", "turns": len(rows), "jitter_ms": args.jitter_ms,
               "first_audio_played_ms_p50": float(np.median(played)) if played else None,
               "first_audio_played_ms_max": max(played) if played else None,
               "underruns": state["playback"]["underruns"], "played_s": state["playback"]["played"] / REPLY_RATE,
               "errors": state["errors"], "rows": rows}
    print(json.dumps(summary))
    ok = len(rows) == args.spoken + args.typed and not state["errors"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
