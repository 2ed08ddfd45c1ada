"""Voice-to-voice on every transport, split by stage, paired in one run.

    .venv/bin/python -m load.latency --rounds 6          # against serve run serve_config.yaml
    .venv/bin/python -m load.latency --transports v1,webrtc --rounds 10
    .venv/bin/python -m load.latency --transports v1_plain,v1_ahead   # preemptive generation off / on

Each round says one sentence hands-free over each transport (protocol v1, the Realtime protocol
over a WebSocket, a WebRTC call, a simulated Twilio phone call), in a random order, each on a
fresh connection, and measures, as the caller hears it, from the true end of the speech (when the
client sent its last sample at real time) to the first reply audio at the client: v1's and the
Realtime WebSocket's first audio message, WebRTC's first loud decoded frame (the caller hears as
a browser does: packets decoded as they arrive, ``load/webrtc_client.py``), the phone's first
media frame. Every turn ends by itself (VAD and Smart Turn, the server's defaults). The clip is
espeak-ng's: its silence is digital zero unless ``--noise-floor-db`` lays a microphone's noise
under it (Silero hears a codec's faint tail after digital zero as speech for a window or two
longer: over WebRTC, Opus's tail moved the VAD's end ~60 ms later than v1's raw samples on 5 of 6
sentences; under a -60 dBFS floor, as any microphone has, both end alike).

The server's share comes from the call's record (``GET /v1/sessions/{id}/record``): the speech's
end as the server placed it and the first reply audio it sent, on the wall clock (client and
server run on one machine here), and the stages between. So each turn splits into

    in       the server's end of speech - the client's (the receive path, and where the VAD put the end)
    turn     the end of speech -> the turn's end (VAD silence and Smart Turn)
    token    -> the LLM's first token     clause -> its first clause
    ctx      -> the first clause sent to the TTS (the user's audio encoded into its context)
    tts      -> the TTS's first chunk     sent   -> first audio sent
    out      first audio at the client - first audio sent (the send path, the client's decoding)

A phone call's record is its carrier's (a token reads it), so the phone row has the caller's
numbers only. Prints a table of medians [min-max] per transport, the paired differences from v1,
and one JSON line.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
import urllib.request

import numpy as np

from load import speech
from load.client import Conversation, add_token_argument
from load.phone import Phone, ulaw_frames
from load.realtime_client import RealtimeConversation
from load.webrtc_client import RtcCall
from pipeline.audio_constants import USER_RATE

BASE = "http://127.0.0.1:8000"
SENTENCES = ["What time does the museum open tomorrow?", "Can you book a table for two people tonight?",
             "Please turn off the lights in the kitchen.", "How far is the station from here?",
             "Tell me a joke about cats.", "I would like to book a flight to Paris on Friday."]
TRANSPORTS = ("v1", "realtime", "webrtc", "phone")
SHORT = 24  # reply tokens (every load tool's reply length on CPU)
LEAD_S = 0.3  # silence before the speech
TAIL_S = 2.5  # and after it (the turn ends within it: the silence fallback is 1.5 s)
STAGES = ("in", "turn", "token", "clause", "ctx", "tts", "sent", "out")


def wall(monotonic: float) -> float:
    """A time.monotonic() reading on the wall clock (the record's clock)."""
    return time.time() - (time.monotonic() - monotonic)


async def v1_turn(base: str, clip: np.ndarray, speech_end: int, token: str | None, query: str = "") -> dict:
    async with Conversation(base.replace("http", "ws") + "/v1/conversation" + query, token=token) as conv:
        await conv.update(max_output_tokens=SHORT)
        turn = await conv.say_hands_free(clip, speech_end=speech_end)
        return {"session_id": conv.ready["session_id"], "ended": wall(turn.ended_at),
                "heard": wall(turn.chunk_times[0])}


async def realtime_turn(base: str, clip: np.ndarray, speech_end: int, token: str | None) -> dict:
    hands_free = {"audio": {"input": {"turn_detection": {"type": "semantic_vad", "create_response": True}}},
                  "max_output_tokens": SHORT}
    async with RealtimeConversation(base.replace("http", "ws") + "/v1/realtime", token=token,
                                    session=hands_free) as conv:
        heard = lambda: next((t for t, e in conv.events if e["type"] == "response.output_audio.delta"), None)  # noqa: E731
        spoken_until = await conv.speak(clip, until=lambda: heard() is not None)
        await conv.wait_for(lambda e: e["type"] == "response.done", 60)
        ended = spoken_until - (len(clip) - speech_end) / USER_RATE
        return {"session_id": conv.session["id"], "ended": wall(ended), "heard": wall(heard())}


async def webrtc_turn(base: str, clip: np.ndarray, speech_end: int, token: str | None) -> dict:
    async with RtcCall(base, credential=token, session={"max_output_tokens": SHORT}) as call:
        await call.wait(lambda c: c.of("session.created"))
        await call.say(clip, speech_end=speech_end)
        await call.wait(lambda c: c.mic.speech_ended_at is not None and c.loud_after(c.mic.speech_ended_at), 60)
        await call.wait(lambda c: c.of("response.done"), 60)
        return {"session_id": call.of("session.created")[0]["session"]["id"], "ended": wall(call.mic.speech_ended_at),
                "heard": wall(call.loud_after(call.mic.speech_ended_at)[0])}


async def phone_turn(base: str, clip: np.ndarray, speech_end: int, token: str | None) -> dict:
    async with Phone(base.replace("http", "ws") + "/v1/phone/twilio", parameters={"ticket": token} if token else None) as phone:
        spoken_until = await phone.speak(ulaw_frames(clip))
        ended = spoken_until - (len(clip) - speech_end) / USER_RATE
        await phone.reply_heard(ended)
        await phone.hang_up()
        return {"session_id": None, "ended": wall(ended), "heard": wall(next(t for t in phone.first_audio_after if t > ended))}


def spoken(pcm: np.ndarray, noise_floor_db: float | None, seed: int) -> tuple[np.ndarray, int]:
    """The clip a microphone sends: LEAD_S of silence, the speech, TAIL_S of silence; with a noise
    floor (white noise at ``noise_floor_db`` dBFS over all of it, as any real microphone has),
    or digital silence (None). Returns it and the sample where the speech ends."""
    clip = speech.padded(pcm, LEAD_S, TAIL_S).astype(np.float64)
    if noise_floor_db is not None:
        clip += np.random.default_rng(seed).normal(0, 32768 * 10 ** (noise_floor_db / 20), len(clip))
    return np.clip(clip, -32768, 32767).astype(np.int16), int(LEAD_S * USER_RATE) + len(pcm)


TURNS = {"v1": v1_turn, "realtime": realtime_turn, "webrtc": webrtc_turn, "phone": phone_turn,
         # v1 with preemptive generation chosen by the session, whatever the server's default
         "v1_ahead": lambda *a: v1_turn(*a, query="?preemptive_generation=true"),
         "v1_plain": lambda *a: v1_turn(*a, query="?preemptive_generation=false")}


def fetch_record(base: str, session_id: str, token: str | None, timeout_s: float = 10.0) -> dict | None:
    """The session's record once it holds a reply with its first audio (it is kept at the session's end)."""
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(urllib.request.Request(
                    f"{base}/v1/sessions/{session_id}/record", headers=headers), timeout=5) as resp:
                rec = json.load(resp)
            for turn in rec["turns"]:
                for reply in turn["replies"]:
                    if reply.get("first_audio_s") is not None and reply.get("speech_end_s") is not None:
                        return {"record": rec, "turn": turn, "reply": reply}
        except OSError:
            pass
        time.sleep(0.2)
    return None


def split(got: dict, found: dict | None) -> dict:
    """One turn's numbers (ms): the caller's voice-to-voice and, with the record, the stages."""
    row = {"v2v": 1000 * (got["heard"] - got["ended"])}
    if found is None:
        return row
    rec, reply = found["record"], found["reply"]
    speech_end = rec["started_at"] + reply["speech_end_s"]
    sent = rec["started_at"] + reply["first_audio_s"]
    t = reply["timings"]
    row.update({"in": 1000 * (speech_end - got["ended"]), "turn": reply["turn_end_ms"],
                "token": reply["turn_end_ms"] + t["llm_first_token_ms"] if "llm_first_token_ms" in t else None,
                "clause": reply["turn_end_ms"] + t["first_clause_ms"] if "first_clause_ms" in t else None,
                "ctx": reply["turn_end_ms"] + t["tts_request_ms"] if "tts_request_ms" in t else None,
                "tts": reply["turn_end_ms"] + t["tts_first_chunk_ms"] if "tts_first_chunk_ms" in t else None,
                "sent": reply["voice_to_voice_ms"], "out": 1000 * (got["heard"] - sent),
                "ended_by": found["turn"].get("ended_by")})
    return row


def _stat(values: list[float]) -> dict | None:
    values = [v for v in values if v is not None]
    if not values:
        return None
    return {"p50": statistics.median(values), "min": min(values), "max": max(values),
            "p90": float(np.percentile(values, 90)), "n": len(values)}


async def main_async(args) -> dict:
    clips = {s: speech.espeak(s) for s in SENTENCES}
    rows: list[dict] = []
    for r in range(args.rounds):
        sentence = SENTENCES[r % len(SENTENCES)]
        clip, speech_end = spoken(clips[sentence], args.noise_floor_db, r)
        row = {"round": r, "sentence": sentence}
        for name in random.sample(args.transports, len(args.transports)):
            got = await TURNS[name](args.base, clip, speech_end, args.token)
            found = None if got["session_id"] is None else await asyncio.to_thread(
                fetch_record, args.base, got["session_id"], args.token)
            row[name] = split(got, found)
        rows.append(row)
    ref = "v1" if "v1" in args.transports else args.transports[0]  # each other transport is paired with it
    out = {"rounds": len(rows), "noise_floor_db": args.noise_floor_db, "transports": {}, "reference": ref,
           "paired_minus_v1_ms": {}, "rows": rows}
    for name in args.transports:
        out["transports"][name] = {k: _stat([row[name].get(k) for row in rows]) for k in ("v2v", *STAGES)}
        if name != ref:
            out["paired_minus_v1_ms"][name] = _stat([row[name]["v2v"] - row[ref]["v2v"] for row in rows])
    return out


def table(res: dict) -> str:
    cell = lambda s: "-" if s is None else f"{s['p50']:.0f} [{s['min']:.0f}-{s['max']:.0f}]"  # noqa: E731
    floor = "digital silence" if res["noise_floor_db"] is None else f"a {res['noise_floor_db']:g} dBFS noise floor"
    lines = [f"voice-to-voice at the caller and its split, ms, median [min-max] over {res['rounds']} paired rounds "
             f"({floor} around the speech)",
             "| transport | voice-to-voice | p90 | " + " | ".join(STAGES) + " |",
             "|---|---|---|" + "---|" * len(STAGES)]
    for name, st in res["transports"].items():
        p90 = "-" if st["v2v"] is None else f"{st['v2v']['p90']:.0f}"
        lines.append(f"| {name} | {cell(st['v2v'])} | {p90} | " + " | ".join(cell(st[k]) for k in STAGES) + " |")
    for name, d in res["paired_minus_v1_ms"].items():
        lines.append(f"{name} - {res['reference']} (paired, same sentence, same round): {cell(d)} ms")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", default=BASE)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--transports", default=",".join(TRANSPORTS),
                    type=lambda v: [t for t in v.split(",") if t in TURNS] or list(TRANSPORTS))
    ap.add_argument("--noise-floor-db", type=lambda v: None if v == "none" else float(v), default=None,
                    help="white noise under the clip at this dBFS (e.g. -60, a quiet room's microphone); "
                         "none (the default): espeak-ng's digital silence")
    add_token_argument(ap)
    args = ap.parse_args(argv)
    res = asyncio.run(main_async(args))
    print(table(res))
    print(json.dumps({"benchmark": "latency", **{k: v for k, v in res.items() if k != "rows"}, "rows": res["rows"]}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
