"""Turn-taking measurement against a running server (hands-free turns, barge-in, echo).

    python -m load.turn_taking [--url ws://127.0.0.1:8000/v1/conversation] [--rounds 10] [--out DIR] [--token T]

Four phases, one session each, all in real time with espeak-ng speech (load/speech.py):
- hands-free: sentences with 0.3 s of silence before, no turn.end; per turn the voice-to-voice
  time (the last sample of speech, as spoken, to the first reply audio received);
- cut-offs: "I would like to book a flight to ... Paris on Friday." with a 500 ms pause, `rounds`
  times: each must be one turn, never two;
- barge-in: a reply plays, a person starts speaking over it after ~1 s of its audio; speech onset
  (as spoken) to ``response.done interrupted``; then the same with the person starting as the
  reply's first chunk arrives (a user who says "no, wait" at once);
- echo: the client plays the reply on a speakerphone (its audio back into the microphone at
  -10 dB, 150 ms later, load/speakerphone.py), `rounds` replies: interruptions counted (want 0);
  then the same with a person speaking over the echo (want each interrupted, and how fast).
Prints a table and one JSON line (also written to OUT/turn_test.json). Against a server with auth on,
pass ``--token`` (default: $GAPLESS_TOKEN), sent as ``Authorization: Bearer`` like the other load tools.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path

import numpy as np

from load import speech
from load.speech import PAUSED, PERSON, SENTENCES
from load.client import Conversation, add_token_argument
from load.speakerphone import Speakerphone
from pipeline.adapters.v1 import protocol as P
from pipeline.audio_constants import REPLY_RATE, USER_RATE



def _pct(xs, q):
    return float(np.percentile(xs, q)) if xs else None


# Medians of voice-to-voice's parts, each from the true end of speech or from transcript.final:
# end of speech -> speech.stopped (the VAD's silence) -> transcript.final (Smart Turn, the
# recogniser's last step) -> LLM first token / first clause / first audio sent (server side).
SPLIT = ("to_final", "final_to_audio", "vad_stopped", "stopped_to_final", "llm_first_token", "first_clause",
         "first_audio")


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x:.0f}"


def _split(rows: list[dict]) -> dict:
    return {k: _pct([r[k] for r in rows if r.get(k) is not None], 50) for k in SPLIT}


async def hands_free(url: str, clips: list[np.ndarray], token: str | None = None) -> tuple[list[dict], int]:
    """Per clip: voice-to-voice (ms) and its split (end of speech -> transcript.final -> first
    audio); and how many turns the server made of the clips."""
    async with Conversation(url, token=token) as conv:
        rows = []
        for pcm in clips:
            tr = await conv.say_hands_free(pcm, speech_end=len(pcm))
            if tr.time_to_first_audio is not None:
                timings = tr.timings or {}
                rows.append({"v2v": 1000 * tr.time_to_first_audio, "to_final": 1000 * (tr.final_at - tr.ended_at),
                             "final_to_audio": 1000 * (tr.chunk_times[0] - tr.final_at),
                             # the finer split (SPLIT): the server's VAD, end of turn + the recogniser's
                             # last step, then response.done's timings (ms after the final, server side)
                             "vad_stopped": 1000 * (tr.speech_stopped_at - tr.ended_at)
                             if tr.speech_stopped_at > tr.ended_at else None,
                             "stopped_to_final": 1000 * (tr.final_at - tr.speech_stopped_at)
                             if tr.speech_stopped_at > tr.ended_at else None,
                             **{k: timings.get(f"{k}_ms") for k in ("llm_first_token", "first_clause", "first_audio")},
                             "partial_every": 1000 * float(np.median(np.diff(tr.partial_times)))
                             if len(tr.partial_times) > 1 else None})
        await asyncio.sleep(2.0)  # let a split-off second half (a cut) show up as a turn of its own
        return rows, len([t for t in conv.turns.values() if t.final_at])


async def _stream_mic(conv: Conversation, t0: float, seconds: float, frame_of, until=None) -> None:
    """Microphone frames in real time from ``t0``: ``frame_of(k, n)`` gives samples [k, k + n)."""
    step = USER_RATE // 50
    for k in range(0, int(seconds * USER_RATE), step):
        await asyncio.sleep(max(0.0, t0 + (k + step) / USER_RATE - time.monotonic()))
        await conv.send(P.client_audio(np.clip(frame_of(k, step), -32768, 32767).astype(np.int16)))
        if until is not None and until():
            return


async def reply_with_mic(url: str, person: np.ndarray | None, echo: bool, seconds: float = 6.0,
                         token: str | None = None, after_s: float = 1.0) -> dict:
    """A typed turn's reply plays (on a speakerphone if ``echo``); with ``person``, they start to
    speak once more than ``after_s`` of reply audio has arrived (0: at its first chunk). Returns
    whether the reply was interrupted and how fast."""
    async with Conversation(url, token=token) as conv:
        t0 = time.monotonic()
        phone = Speakerphone(t0)
        turn = await conv.send_text_turn("Tell me a long story about the sea, please.")
        person_at: list[int] = []

        def played_s() -> float:
            tr = conv.turns.get(turn)
            return sum(len(c) for c in tr.chunks) / REPLY_RATE if tr else 0.0

        fed = {"n": 0}

        def frame_of(k: int, n: int) -> np.ndarray:
            tr = conv.turns.get(turn)
            if tr is not None:  # new chunks go on the speaker as they arrived
                for i in range(fed["n"], len(tr.chunks)):
                    phone.receive(tr.chunks[i], tr.chunk_times[i])
                fed["n"] = len(tr.chunks)
                if tr.done_at and tr.interrupted:
                    phone.flush(tr.done_at)
            x = phone.echo(k, n) * 32768.0 if echo else np.zeros(n, np.float32)
            if person is not None:
                if not person_at and played_s() > after_s:
                    person_at.append(k)
                if person_at:
                    seg = person[k - person_at[0]:k - person_at[0] + n]
                    x[: len(seg)] += seg
            return x

        def done() -> bool:
            tr = conv.turns.get(turn)
            return bool(tr and tr.done_at)

        await _stream_mic(conv, t0, seconds, frame_of, until=done)
        if not done():
            await conv.wait_for(lambda m: m["type"] == "response.done" and m.get("turn") == turn, 60)
        tr = conv.turns[turn]
        out = {"interrupted": bool(tr.interrupted), "audio_s": played_s()}
        if person_at and tr.interrupted:
            onset_at = t0 + person_at[0] / USER_RATE  # the person's first sample, as spoken
            out["barge_in_ms"] = 1000 * (tr.done_at - onset_at)
        return out


async def main_async(args) -> dict:
    clips = [speech.padded(speech.espeak(t), 0.3, 0.0) for t in SENTENCES]
    paused = speech.padded(speech.with_pauses(*PAUSED), 0.3, 0.0)
    person = speech.espeak(PERSON).astype(np.float32)
    spoken = (clips * args.clips)[:args.clips]
    rows, turns = await hands_free(args.url, spoken, args.token)
    v2v = [r["v2v"] for r in rows]
    if args.hands_free_only:
        return {"voice_to_voice_ms": {"n": len(v2v), "p50": _pct(v2v, 50), "p95": _pct(v2v, 95), "max": max(v2v, default=None)},
                "voice_to_voice_split_ms": _split(rows),
                "partial_every_ms": _pct([r["partial_every"] for r in rows if r["partial_every"]], 50),
                "hands_free_turns": {"clips": len(spoken), "turns": turns}}
    _, paused_turns = await hands_free(args.url, [paused] * args.rounds, args.token)
    barge = [await reply_with_mic(args.url, person, echo=False, token=args.token) for _ in range(args.rounds)]
    first = [await reply_with_mic(args.url, person, echo=False, token=args.token, after_s=0.0) for _ in range(args.rounds)]
    echo_only = [await reply_with_mic(args.url, None, echo=True, token=args.token) for _ in range(args.rounds)]
    echo_person = [await reply_with_mic(args.url, person, echo=True, token=args.token) for _ in range(args.rounds)]
    b_ms = [r["barge_in_ms"] for r in barge if "barge_in_ms" in r]
    f_ms = [r["barge_in_ms"] for r in first if "barge_in_ms" in r]
    e_ms = [r["barge_in_ms"] for r in echo_person if "barge_in_ms" in r]
    return {
        "voice_to_voice_ms": {"n": len(v2v), "p50": _pct(v2v, 50), "p95": _pct(v2v, 95), "max": max(v2v, default=None)},
        # medians of the split: end of speech -> transcript.final (end-of-turn detection and the
        # recogniser's last step), transcript.final -> first reply audio (LLM and TTS)
        "voice_to_voice_split_ms": _split(rows),
        "partial_every_ms": _pct([r["partial_every"] for r in rows if r["partial_every"]], 50),
        "hands_free_turns": {"clips": len(spoken), "turns": turns},
        "paused_sentence": {"runs": args.rounds, "turns": paused_turns, "cut": paused_turns - args.rounds},
        "barge_in_ms": {"n": len(b_ms), "of": len(barge), "p50": _pct(b_ms, 50), "p95": _pct(b_ms, 95), "max": max(b_ms, default=None)},
        "barge_in_first_chunk_ms": {"n": len(f_ms), "of": len(first), "p50": _pct(f_ms, 50), "p95": _pct(f_ms, 95),
                                    "max": max(f_ms, default=None)},
        "echo_false_barge_ins": {"replies": len(echo_only), "interrupted": sum(r["interrupted"] for r in echo_only),
                                 "reply_audio_s_median": _pct([r["audio_s"] for r in echo_only], 50)},
        "barge_in_over_echo_ms": {"n": len(e_ms), "of": len(echo_person), "p50": _pct(e_ms, 50), "max": max(e_ms, default=None)},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", default="ws://127.0.0.1:8000/v1/conversation")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--hands-free-only", action="store_true", help="only the hands-free turns (voice-to-voice)")
    ap.add_argument("--clips", type=int, default=2 * len(SENTENCES), help="hands-free turns (the sentences in turn)")
    add_token_argument(ap)
    args = ap.parse_args()
    res = asyncio.run(main_async(args))
    rows = [
        ("voice-to-voice p50 / p95 / max (ms)", "{p50:.0f} / {p95:.0f} / {max:.0f} over {n} turns".format(**res["voice_to_voice_ms"])),
        ("  p50 split: speech end -> final -> audio", "{to_final:.0f} + {final_to_audio:.0f}".format(**res["voice_to_voice_split_ms"])),
        ("  p50 finer: end -> speech.stopped -> final", " + ".join(_ms(res["voice_to_voice_split_ms"][k])
                                                            for k in ("vad_stopped", "stopped_to_final"))),
        ("  p50 server after final: LLM token / clause / audio", " / ".join(
            _ms(res["voice_to_voice_split_ms"][k]) for k in ("llm_first_token", "first_clause", "first_audio"))),
        ("partial transcript every (ms, median)", f"{res['partial_every_ms']:.0f}" if res["partial_every_ms"] else "-"),
        ("hands-free clips -> turns", "{clips} -> {turns}".format(**res["hands_free_turns"])),
    ]
    if not args.hands_free_only:
        rows += [
            ("paused sentence: runs cut", "{cut} of {runs}".format(**res["paused_sentence"])),
            ("barge-in p50 / p95 / max (ms)", "{p50:.0f} / {p95:.0f} / {max:.0f} ({n} of {of} interrupted)".format(**res["barge_in_ms"])
             if res["barge_in_ms"]["n"] else "none interrupted"),
            ("barge-in at the first chunk p50 / p95 / max (ms)",
             "{p50:.0f} / {p95:.0f} / {max:.0f} ({n} of {of} interrupted)".format(**res["barge_in_first_chunk_ms"])
             if res["barge_in_first_chunk_ms"]["n"] else "none interrupted"),
            ("echo only: replies interrupted", "{interrupted} of {replies}".format(**res["echo_false_barge_ins"])),
            ("person over echo: barge-in p50 / max (ms)", "{p50:.0f} / {max:.0f} ({n} of {of})".format(**res["barge_in_over_echo_ms"])
             if res["barge_in_over_echo_ms"]["n"] else "none interrupted"),
        ]
    w = max(len(r[0]) for r in rows)
    for name, val in rows:
        print(f"{name:<{w}}  {val}")
    line = json.dumps({"turn_test": res})
    print(line)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "turn_test.json").write_text(line + "\n")


if __name__ == "__main__":
    main()
