"""Hearing through noise, measured offline: the server's ears over speech and noise mixed in code.

    .venv/bin/python -m load.noisy                                  # every noise, SNR 20 10 5 0 dB
    .venv/bin/python -m load.noisy --noises babble,bursts --snr 5 --minutes 10 --phone

The noises (``load/noises.py``: babble, pink, brown, tv, bursts, from a seed) are laid under the
load tools' spoken sentences (espeak-ng) at each SNR: the noise's RMS against the speech's, over
their sounding parts. Each goes through the session's own ears in 20 ms frames, as a microphone
sends them: ``Listener`` (WebRTC's echo canceller, then Silero VAD) with the served settings, and
Smart Turn, by the rules of ``TurnTaker`` (pipeline/conversation/turns.py); with ``--phone``,
through 8 kHz μ-law first and the server's phone decoder back to 16 kHz; with ``--suppressor
KIND``, the session's ``noise_reduction`` (suppression.py: webrtc, rnnoise, deepfilter) between
the echo canceller and the VAD, as the server runs it. No server, no engines.

Per noise and SNR:

- **false barge-ins per minute**: ``--minutes`` of the noise alone while a reply plays (its echo in
  the microphone at -10 dB, 150 ms late, as a speakerphone, and the canceller told of it): each
  time the VAD has heard ``barge_in_min_speech_ms`` of speech, a reply would have been cut;
- **missed barge-ins**: each sentence said over the reply and the noise (1.5 s of them first):
  no barge-in while it is said (or 200 ms after); one the noise made just before it is counted
  apart ("cut by the noise first"); and the barge-in's latency from its first sound;
- **end of turn**: each sentence with the noise going on, no reply: when the turn ends after the
  true end of the speech (negative: at a pause mid-sentence), how many waited for the silence
  fallback, and how many had not ended 2.5 s after it (the VAD hears the noise as speech);
- **CPU**: the ears' (canceller, suppressor, VAD) CPU seconds per second of audio, one stream;
  and the microphone path's before them (mixing, the phone line).

The row ``none`` is the same without noise. Prints a table and one JSON line.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np

from load import noises, speech
from load.phone import ulaw_frames
from load.turn_end import SENTENCES, replay
from pipeline.adapters.audio_formats import PCMU, Decoder
from pipeline.audio import float_to_int16, int16_to_float, resample
from pipeline.audio_constants import REPLY_RATE, USER_RATE
from pipeline.conversation.ears.listening import Listener
from pipeline.conversation.ears.suppression import suppressor
from pipeline.session_config import NOISE_REDUCTION, SessionConfig

FRAME = USER_RATE // 50
REPLY = ("Let me tell you about the museum. It opens at nine in the morning and closes at six. On Fridays "
         "it stays open until ten, and the first Sunday of the month is free for everyone.")
ECHO_DB, ECHO_DELAY_S = -10.0, 0.15  # a speakerphone (load/speakerphone.py)
SNRS = (20.0, 10.0, 5.0, 0.0)


def _phone(pcm: np.ndarray) -> np.ndarray:
    """16 kHz int16 through a phone line: 8 kHz μ-law, then the server's decoder."""
    decoder = Decoder(PCMU)
    return np.concatenate([decoder.decode(f) for f in ulaw_frames(pcm)] + [decoder.flush()])[: len(pcm)]


def _mic(parts: list[np.ndarray], args) -> np.ndarray:
    """The microphone's audio as the ears get it: mixed, then through the phone line with ``--phone``."""
    x = float_to_int16(np.clip(sum(parts), -1, 1))
    return _phone(x) if args.phone else x


def _suppressed(pcm: np.ndarray, cfg: SessionConfig) -> np.ndarray:
    """What the VAD hears of ``pcm`` with no reply playing: the session's suppressor over it in
    20 ms frames (its delay dropped), padded to its length."""
    if cfg.noise_reduction is None:
        return pcm
    s = suppressor(cfg.noise_reduction)
    out = np.concatenate([s.process(pcm[i:i + FRAME]) for i in range(0, len(pcm), FRAME)])
    return np.pad(out, (0, len(pcm) - len(out)))[: len(pcm)]


class Reply:
    """A reply playing on a speakerphone: its echo in the microphone, its audio to the canceller."""

    def __init__(self):
        voice = int16_to_float(speech.espeak(REPLY))
        self.pcm = voice * 10 ** (-3 / 20) / max(1e-9, float(np.max(np.abs(voice))))  # peaks at -3 dBFS

    def over(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        """(its echo in ``n`` microphone samples, its audio at the reply rate) from its start, on repeat."""
        played = np.tile(self.pcm, -(-n // len(self.pcm)) + 1)[:n]
        delay = int(ECHO_DELAY_S * USER_RATE)
        echo = np.concatenate([np.zeros(delay, np.float32), played[: n - delay]]) * 10 ** (ECHO_DB / 20)
        return echo.astype(np.float32), float_to_int16(resample(played, USER_RATE, REPLY_RATE))


def barge_ins(mic: np.ndarray, reply_24k: np.ndarray, cfg: SessionConfig) -> tuple[list[int], np.ndarray, float]:
    """Where a barge-in would have cut the reply: the samples where the VAD's speech reached
    barge_in_min_speech_ms (once per speech run), and per frame whether it had; and the CPU
    seconds the ears took."""
    ears, per_frame = Listener(cfg.vad_settings, cfg.echo_cancellation, noise_reduction=cfg.noise_reduction), REPLY_RATE // 50
    at, cutting, armed, cpu = [], [], True, time.process_time()
    for k, i in enumerate(range(0, len(mic) - FRAME + 1, FRAME)):
        ears.reference(reply_24k[k * per_frame:(k + 1) * per_frame])  # the reply, as it is sent
        ears.hear(mic[i:i + FRAME])
        cutting.append(ears.vad.speech_ms >= cfg.barge_in_min_speech_ms)
        if armed and cutting[-1]:
            at.append(i + FRAME)
            armed = False
        elif ears.vad.speech_ms == 0 and not ears.speaking:
            armed = True
    return at, np.array(cutting), time.process_time() - cpu


def one(kind: str, snr: float | None, args, cfg: SessionConfig, clips: dict, reply: Reply, level: float) -> dict:
    """One noise at one SNR (``kind`` "none": no noise)."""
    seconds = 60 * args.minutes
    def noise_for(n: int, seed: int) -> np.ndarray:
        return np.zeros(n, np.float32) if kind == "none" else \
            noises.at_snr(noises.noise(kind, n / USER_RATE, seed), level, snr)

    n = int(seconds * USER_RATE)
    echo, reply_24k = reply.over(n)
    started = time.process_time()
    mic = _mic([echo, noise_for(n, args.seed)], args)
    mic_cpu = time.process_time() - started  # mixing, the phone line
    false_at, _, cpu = barge_ins(mic, reply_24k, cfg)
    missed, early, latency, ends, cut, fallback, never = 0, 0, [], [], 0, 0, 0
    for j, (text, clip) in enumerate(clips.items()):
        lead, tail = int(1.5 * USER_RATE), int(2.5 * USER_RATE)
        voice = np.concatenate([np.zeros(lead), int16_to_float(clip), np.zeros(tail)]).astype(np.float32)
        under = noise_for(len(voice), args.seed + 1 + j)
        echo, reply_24k = reply.over(len(voice))
        at, cutting, _ = barge_ins(_mic([voice, under, echo], args), reply_24k, cfg)
        said = slice(lead // FRAME, (lead + len(clip) + int(0.2 * USER_RATE)) // FRAME)
        if cutting[lead // FRAME - 1]:
            early += 1  # the noise had cut the reply already (a false barge-in just before)
        elif hits := [a for a in at if lead <= a <= lead + len(clip) + int(0.2 * USER_RATE)]:
            latency.append(1000 * (hits[0] - lead) / USER_RATE)
        elif not cutting[said].any():
            missed += 1
        mic = _mic([voice, under], args)
        ms, by, _ = replay(mic, lead + len(clip), cfg, recheck_ms=100, heard=_suppressed(mic, cfg))
        if by == "never":
            never += 1
            continue
        ends.append(ms)
        cut += ms < 0
        fallback += by == "silence"
    after = [e for e in ends if e >= 0]
    return {"noise": kind, "snr_db": snr, "false_barge_ins_per_min": len(false_at) / args.minutes,
            "missed_barge_ins": missed, "cut_by_noise_first": early, "sentences": len(clips),
            "barge_in_ms_p50": statistics.median(latency) if latency else None,
            "end_of_turn_ms_p50": statistics.median(after) if after else None,
            "end_of_turn_ms_p90": float(np.percentile(after, 90)) if after else None,
            "ended_mid_sentence": cut, "silence_fallback": fallback, "never_ended": never,
            "ears_cpu_s_per_audio_s": cpu / seconds, "mic_path_cpu_s_per_audio_s": mic_cpu / seconds}


def table(rows: list[dict], args) -> str:
    f = lambda v, fmt="{:.0f}": "-" if v is None else fmt.format(v)  # noqa: E731
    path = ("phone (8 kHz μ-law)" if args.phone else "16 kHz") + \
        f", noise_reduction {args.suppressor}, vad_foreground_db {args.foreground_db:g}"
    lines = [f"the server's ears through noise, {path}; {args.minutes:g} min of each noise alone during a reply; "
             f"{len(SENTENCES)} sentences over it",
             "| noise | SNR dB | false barge-ins /min | missed barge-ins | cut by the noise first | barge-in p50 ms |"
             " end of turn p50 / p90 ms | ended mid-sentence | silence fallback | never ended | ears CPU s/s | mic path CPU s/s |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['noise']} | {f(r['snr_db'])} | {r['false_barge_ins_per_min']:.1f} | "
                     f"{r['missed_barge_ins']} of {r['sentences']} | {r['cut_by_noise_first']} | "
                     f"{f(r['barge_in_ms_p50'])} | {f(r['end_of_turn_ms_p50'])} / {f(r['end_of_turn_ms_p90'])} | "
                     f"{r['ended_mid_sentence']} | {r['silence_fallback']} | {r['never_ended']} | "
                     f"{r['ears_cpu_s_per_audio_s']:.4f} | {r['mic_path_cpu_s_per_audio_s']:.4f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--noises", default=",".join(noises.KINDS), type=lambda v: v.split(","))
    ap.add_argument("--snr", default=",".join(f"{s:g}" for s in SNRS), type=lambda v: [float(s) for s in v.split(",")])
    ap.add_argument("--minutes", type=float, default=2.0, help="of each noise alone during a reply")
    ap.add_argument("--phone", action="store_true", help="through 8 kHz μ-law and the phone decoder")
    ap.add_argument("--suppressor", choices=("none",) + NOISE_REDUCTION, default="none",
                    help="the session's noise_reduction: a suppressor between the echo canceller and the VAD")
    ap.add_argument("--foreground-db", type=float, default=SessionConfig().vad_foreground_db,
                    help="vad_foreground_db (0, the default: the foreground rule off; 10: what docs/turn-taking.md measured)")
    ap.add_argument("--seed", type=int, default=7)
    args = ap.parse_args(argv)
    for kind in args.noises:
        if kind not in noises.KINDS:
            ap.error(f"unknown noise {kind!r}; one of {', '.join(noises.KINDS)}")
    cfg = SessionConfig(noise_reduction=None if args.suppressor == "none" else args.suppressor,
                        vad_foreground_db=args.foreground_db)
    reply = Reply()
    clips = {s: speech.espeak(s) for s in SENTENCES}
    level = statistics.median(noises.speech_rms(c) for c in clips.values())
    rows = [one("none", None, args, cfg, clips, reply, level)]
    rows += [one(kind, snr, args, cfg, clips, reply, level) for kind in args.noises for snr in args.snr]
    print(table(rows, args))
    print(json.dumps({"benchmark": "noisy", "phone": args.phone, "suppressor": args.suppressor,
                      "foreground_db": args.foreground_db,
                      "minutes": args.minutes, "seed": args.seed,
                      "speech_rms_dbfs": 20 * np.log10(level), "rows": rows}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
