"""Where hands-free turns end, replayed offline: the session's VAD and Smart Turn over spoken clips.

    .venv/bin/python -m load.turn_end                   # the sentences below, as the server judges now
    .venv/bin/python -m load.turn_end --recheck-ms 0    # judged once per pause, as before

Each clip (espeak-ng, 300 ms of silence before, 2 s after) goes through ``VoiceActivity`` in 20 ms
frames, as a microphone sends it; at ``speech.stopped`` Smart Turn judges the audio from the
VAD's onset (less the pre-roll) to now, then again after each ``--recheck-ms`` more of silence,
and the turn ends at the first verdict of ``--threshold`` or more, or at ``--max-silence-ms``.
The same rules as ``TurnTaker._pause`` (pipeline/conversation/turns.py), on one process's clock:
no network, no engines. For each clip: when the turn ended relative to the true end of the
speech (negative: before it, at a pause mid-sentence) and what ended it. Prints a table and one
JSON line. No server needed; ~25 ms of one core per Smart Turn call.
"""
from __future__ import annotations

import argparse
import json

import numpy as np

from load import speech
from pipeline.audio_constants import USER_RATE
from pipeline.conversation.ears.smart_turn import shared_model
from pipeline.conversation.ears.vad import VoiceActivity
from pipeline.session_config import SessionConfig

FRAME = USER_RATE // 50
SENTENCES = ["Please turn off the lights in the kitchen.", "What is the weather like in London today?",
             "Tell me a joke about cats.", "I would like to book a flight to Paris on Friday.",
             "What time does the museum open tomorrow?", "Can you book a table for two people tonight?",
             "How far is the station from here?", "Could you repeat that please?", "Hello.", "Yes.",
             "I need to change my address, I moved last month to a new flat.",
             "My order number is four five six, can you check where it is?", "Thanks, that is all for now.",
             "If it rains tomorrow, we will stay at home and watch a film."]


def replay(pcm: np.ndarray, speech_end: int, cfg: SessionConfig, recheck_ms: float,
           heard: np.ndarray | None = None) -> tuple[float, str, list[float]]:
    """(ms from the speech's end to the turn's end, what ended it, Smart Turn's verdicts).
    ``heard``: what the VAD hears instead of ``pcm`` (suppressed audio); Smart Turn hears ``pcm``."""
    heard = pcm if heard is None else heard
    vad, model = VoiceActivity(cfg.vad_settings), shared_model()
    preroll = int(cfg.vad_preroll_ms * USER_RATE / 1000)
    start = check_at = None
    verdicts: list[float] = []
    for i in range(0, len(pcm), FRAME):
        now = i + FRAME
        for ev in vad.push(heard[i:now]):
            if ev.kind == "speech.started" and start is None:
                start = max(0, ev.sample - preroll)
            elif ev.kind == "speech.stopped":
                check_at = vad.silence_ms
        if vad.speaking or start is None or check_at is None:
            check_at = None if vad.speaking else check_at
            continue
        if vad.silence_ms >= check_at:
            verdicts.append(model.probability(pcm[start:now]))
            if verdicts[-1] >= cfg.eot_threshold:
                return 1000 * (now - speech_end) / USER_RATE, "smart_turn", verdicts
            check_at = vad.silence_ms + recheck_ms if recheck_ms > 0 else float("inf")
        if vad.silence_ms >= cfg.eot_max_silence_ms:
            return 1000 * (now - speech_end) / USER_RATE, "silence", verdicts
    return float("nan"), "never", verdicts


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--recheck-ms", type=float, default=100.0, help="0: Smart Turn judges each pause once")
    ap.add_argument("--min-silence-ms", type=float, default=SessionConfig().vad_min_silence_ms)
    ap.add_argument("--max-silence-ms", type=float, default=SessionConfig().eot_max_silence_ms)
    ap.add_argument("--threshold", type=float, default=SessionConfig().eot_threshold)
    args = ap.parse_args(argv)
    cfg = SessionConfig(vad_min_silence_ms=args.min_silence_ms, eot_max_silence_ms=args.max_silence_ms,
                        eot_threshold=args.threshold)
    rows = []
    for text in SENTENCES:
        clip = speech.espeak(text)
        pcm = speech.padded(clip, 0.3, 2.0)
        ms, by, verdicts = replay(pcm, int(0.3 * USER_RATE) + len(clip), cfg, args.recheck_ms)
        rows.append({"sentence": text, "turn_end_ms": round(ms), "ended_by": by,
                     "verdicts": [round(v, 2) for v in verdicts]})
    print(f"| turn end after the speech (ms) | ended by | Smart Turn's verdicts | sentence |\n|---|---|---|---|")
    for r in rows:
        print(f"| {r['turn_end_ms']} | {r['ended_by']} | {' '.join(f'{v:.2f}' for v in r['verdicts'])} | {r['sentence']} |")
    after = [r["turn_end_ms"] for r in rows if r["turn_end_ms"] >= 0]
    summary = {"benchmark": "turn_end", "recheck_ms": args.recheck_ms, "min_silence_ms": args.min_silence_ms,
               "max_silence_ms": args.max_silence_ms, "threshold": args.threshold,
               "ended_mid_sentence": sum(r["turn_end_ms"] < 0 for r in rows),
               "by_silence": sum(r["ended_by"] == "silence" for r in rows),
               "p50_ms": float(np.median(after)) if after else None,
               "p90_ms": float(np.percentile(after, 90)) if after else None, "rows": rows}
    print(f"ended at the speech's end: p50 {summary['p50_ms']} ms, p90 {summary['p90_ms']} ms; "
          f"{summary['by_silence']} by the silence fallback; {summary['ended_mid_sentence']} mid-sentence")
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
