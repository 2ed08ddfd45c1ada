"""Backchannels and interruptions over a playing reply, measured in-process in real time.

Each trial is a fresh v1 session on the tiny engines with ``resume_false_interruption`` on: a
typed turn starts a long reply and, once ~1 s of it has been sent, a person (espeak, a headset)
says a backchannel ("mm-hm", "yeah", "right", "okay", "uh-huh", a laugh) or an interruption
("stop", "wait", "no, I meant Paris"). The server's real ears judge it (Silero VAD, Smart Turn
v3.2); the recogniser is an oracle that hears what was said (the tiny recogniser's random weights
recognise nothing): its partial comes when the words have been spoken, its final at the turn's
end. Measured per kind:

- cut: replies ended by it (a backchannel should cut none; an interruption every one);
- took a turn: a user turn was made of it;
- pause ms: from ``response.paused`` to ``response.resumed`` (how long the caller heard silence);
  after words ms: from the end of the person's words to ``response.resumed`` (the silence after them);
- stopped ms: from the person's first sample to the reply's audio stopping (paused or cut);
- mismatched: trials whose sent reply audio is not, sample for sample, the start of what the TTS
  made (a chunk skipped, repeated or out of order); still paused: neither resumed nor cut 2 s after
  the words.

Settings compared in one run, trials interleaved in a seeded order: ``--backchannel-max-ms``
values (0: a backchannel's pause lasts until its turn ends as usual).

    python -m load.backchannels --rounds 4 --backchannel-max-ms 0,800
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import time

import numpy as np

from load import speech
from pipeline.adapters.v1 import protocol as P
from pipeline.adapters.v1.adapter import Session
from pipeline.audio_constants import USER_RATE
from pipeline.session_config import SessionConfig

BACKCHANNELS = ["Mm-hm.", "Yeah.", "Right.", "Okay.", "Uh-huh.", "Ha ha ha."]
INTERRUPTIONS = ["Stop.", "Wait.", "No, I meant Paris."]
FRAME = 320


class Oracle:
    """The engines, hearing ``text`` as said: a partial once ``samples`` of a turn's audio are in
    (here: the utterance's whole audio), the final at the turn's end if ``final_from`` samples were
    heard (default: half of them; less is a turn cut short by a pause); and every TTS chunk made is
    kept, to compare with what was sent."""

    def __init__(self, inner, text: str, samples: int, final_from: int | None = None):
        self.inner, self.text, self.samples = inner, text, samples
        self.final_from = samples // 2 if final_from is None else final_from
        self.heard: dict[str, int] = {}
        self.made: list[np.ndarray] = []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    async def stt_open(self, sid, language=None):
        self.heard[sid] = 0
        return await self.inner.stt_open(sid, language)

    async def stt_push(self, sid, pcm):
        events = [ev for ev in await self.inner.stt_push(sid, pcm) if ev["kind"] not in ("partial", "endpoint")]
        before, self.heard[sid] = self.heard.get(sid, 0), self.heard.get(sid, 0) + len(pcm)
        if before < self.samples <= self.heard[sid]:
            events.insert(0, {"kind": "partial", "text": self.text})
        return events

    async def stt_finish(self, sid):
        _, words = await self.inner.stt_finish(sid)
        return (self.text if self.heard.get(sid, 0) >= self.final_from else ""), words

    async def stt_peek(self, sid):
        peeked = await self.inner.stt_peek(sid)
        return None if peeked is None else (self.text if self.heard.get(sid, 0) >= self.final_from else "", peeked[1])

    async def tts_stream(self, text, context, *voice):
        ahead = asyncio.current_task().get_name() == "first-clause"  # a reply started ahead of a turn's end
        async for pcm, codes in self.inner.tts_stream(text, context, *voice):
            if not ahead:
                self.made.append(np.array(pcm))
            yield pcm, codes


class Recorder:
    def __init__(self):
        self.msgs: list[tuple[float, dict]] = []
        self._arrived = asyncio.Condition()

    async def __call__(self, frame: bytes) -> None:
        self.msgs.append((time.monotonic(), P.unpack(frame)))
        async with self._arrived:
            self._arrived.notify_all()

    def of(self, kind: str) -> list[tuple[float, dict]]:
        return [(t, m) for t, m in self.msgs if m["type"] == kind]

    async def wait(self, pred, timeout: float = 30) -> None:
        async with self._arrived:
            await asyncio.wait_for(self._arrived.wait_for(lambda: pred(self)), timeout)


async def trial(engines, said: str, backchannel_max_ms: float) -> dict:
    person = speech.espeak(said)
    oracle = Oracle(engines, said, len(person))
    rec = Recorder()
    cfg = SessionConfig(resume_false_interruption=True, backchannel_max_ms=backchannel_max_ms)
    s = Session(rec, oracle, cfg)
    await s.start()
    await s.on_frame(P.client_text("Tell me a long story."))
    t0, person_at, person_t = time.monotonic(), None, None
    for k in range(0, 8 * USER_RATE, FRAME):  # up to 8 s of microphone, in real time
        await asyncio.sleep(max(0.0, t0 + k / USER_RATE - time.monotonic()))
        mic = np.zeros(FRAME, np.int16)
        if person_at is None and len(rec.of("audio")) > 12:  # ~1 s of the reply has been sent
            person_at, person_t = k, time.monotonic()
        if person_at is not None:
            mic = np.pad(person[k - person_at:k - person_at + FRAME], (0, FRAME))[:FRAME]
        await s.on_frame(P.client_audio(mic))
        if person_at is not None and k - person_at > len(person) + 2 * USER_RATE:
            break  # 2 s after the person's words: cut, resumed, or taken for a turn by now
    await s.close()
    first = [m for _, m in rec.of("response.done") if m["turn"] == 1]
    cut = bool(first and first[0]["interrupted"])
    paused = [t for t, m in rec.of("response.paused") if m["turn"] == 1]
    resumed = [t for t, m in rec.of("response.resumed") if m["turn"] == 1]
    done = [t for t, m in rec.of("response.done") if m["turn"] == 1 and m["interrupted"]]
    stopped = (paused or done)[0] if person_t is not None and (paused or cut) else None
    sent = [m for _, m in rec.of("audio") if m["turn"] == 1]
    played = np.concatenate([np.frombuffer(m["pcm"], "<i2") for m in sent]) if sent else np.zeros(0, np.int16)
    made = np.concatenate(oracle.made) if oracle.made else np.zeros(0, np.int16)
    exact = len(played) <= len(made) and np.array_equal(played, made[:len(played)])
    return {"said": said, "backchannel_max_ms": backchannel_max_ms, "cut": cut,
            "took_turn": len([m for _, m in rec.of("transcript.final")]) > 1,
            "pause_ms": 1000 * (resumed[0] - paused[0]) if paused and resumed else None,
            "after_words_ms": 1000 * (resumed[0] - person_t) - 1000 * len(person) / USER_RATE if paused and resumed else None,
            "stopped_ms": 1000 * (stopped - person_t) if stopped is not None else None,
            "exact": bool(exact)}


def _p(values, q):
    values = [v for v in values if v is not None]
    return round(float(np.percentile(values, q))) if values else None


def table(rows: list[dict]) -> list[dict]:
    out = []
    for setting in sorted({r["backchannel_max_ms"] for r in rows}):
        for kind, names in (("backchannel", BACKCHANNELS), ("interruption", INTERRUPTIONS)):
            rs = [r for r in rows if r["backchannel_max_ms"] == setting and r["said"] in names]
            out.append({"backchannel_max_ms": setting, "kind": kind, "trials": len(rs),
                        "cut": sum(r["cut"] for r in rs), "took_turn": sum(r["took_turn"] for r in rs),
                        "pause_ms_p50": _p([r["pause_ms"] for r in rs], 50),
                        "pause_ms_max": _p([r["pause_ms"] for r in rs], 100),
                        "after_words_ms_p50": _p([r["after_words_ms"] for r in rs], 50),
                        "after_words_ms_max": _p([r["after_words_ms"] for r in rs], 100),
                        "stopped_ms_p50": _p([r["stopped_ms"] for r in rs], 50),
                        "still_paused": sum(r["pause_ms"] is None and not r["cut"] and r["stopped_ms"] is not None
                                            for r in rs),
                        "mismatched": sum(not r["exact"] for r in rs)})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=4, help="each utterance this many times per setting")
    ap.add_argument("--backchannel-max-ms", default="0,800")
    ap.add_argument("--seed", type=int, default=7)
    args = ap.parse_args()
    from pipeline.llm.config import LLMConfig
    from pipeline.services import LocalBackends
    from pipeline.stt.config import STTConfig
    from pipeline.tts.config import TTSConfig

    engines = LocalBackends.build(STTConfig.tiny(num_slots=4, endpoint_ms=None), LLMConfig.tiny(max_output_tokens=60),
                                  TTSConfig.tiny())
    settings = [float(v) for v in args.backchannel_max_ms.split(",")]
    plan = [(said, ms) for _ in range(args.rounds) for said in BACKCHANNELS + INTERRUPTIONS for ms in settings]
    random.Random(args.seed).shuffle(plan)
    rows = [asyncio.run(trial(engines, said, ms)) for said, ms in plan]
    summary = table(rows)
    cols = list(summary[0])
    print("| " + " | ".join(cols) + " |\n|" + "---|" * len(cols))
    for r in summary:
        print("| " + " | ".join("-" if r[c] is None else str(r[c]) for c in cols) + " |")
    print(json.dumps({"benchmark": "backchannels", "rounds": args.rounds, "seed": args.seed, "rows": summary}))


if __name__ == "__main__":
    main()
