"""Simulated phone calls over a carrier's media stream, and the phone-call benchmark.

:class:`Phone` is the carrier's side of one call, written from Twilio's Media Streams
documentation (and Telnyx's), independent of gapless's code: it sends ``connected``, ``start``
and the caller's audio as 20 ms μ-law ``media`` frames at real time; it plays what it receives at
real time (8 kHz μ-law: 8 bytes a millisecond) and echoes each ``mark`` once the audio before it
has played; ``clear`` drops the queued audio and echoes its marks at once, as Twilio does.

What it measures, as a caller hears it: dead air inside a reply (the playback queue ran dry
before the reply's next frame came), and voice-to-voice, from the end of the caller's speech to
the first reply audio arriving.

    .venv/bin/python -m load.phone --calls 4 --turns 3     # against serve run serve_config.yaml

prints a table and one JSON line.
"""
from __future__ import annotations

import argparse
import asyncio
import audioop
import base64
import json
import statistics
import time

import numpy as np
import websockets
from scipy.signal import resample_poly

from load import speech
from load.client import add_token_argument

URL = "ws://127.0.0.1:8000/v1/phone/twilio"
FRAME_MS = 20
BYTES_PER_MS = 8  # 8 kHz μ-law
REPLY_IDLE_S = 1.5  # no reply audio this long after some: the reply is over
SENTENCES = ["What time does the museum open tomorrow?", "Can you book a table for two people tonight?",
             "Tell me a short story about a lighthouse.", "How far is the station from here?"]


def ulaw_frames(pcm16k: np.ndarray) -> list[bytes]:
    """16 kHz int16 -> 20 ms frames of 8 kHz μ-law (scipy and the standard library's G.711)."""
    pcm8k = np.clip(resample_poly(pcm16k.astype(np.float64), 1, 2), -32768, 32767).astype("<i2")
    data = audioop.lin2ulaw(pcm8k.tobytes(), 2)
    step = FRAME_MS * BYTES_PER_MS
    data += b"\xff" * (-len(data) % step)
    return [data[i:i + step] for i in range(0, len(data), step)]


class Phone:
    def __init__(self, url: str = URL, provider: str = "twilio", parameters: dict | None = None,
                 local_address: str | None = None):
        self.url, self.provider, self.parameters = url, provider, parameters or {}
        self.local_address = local_address  # the loopback address to call from (tests: one per test)
        self.stream_id = "MZ" + format(int(time.time() * 1e6), "032x")[-32:]
        self.received: list[tuple[float, int]] = []  # (arrival, bytes) of each media frame
        self.marks: list[str] = []  # marks in the order they came
        self.echoed: list[str] = []
        self.clears: list[float] = []  # when each clear came
        self.gaps: list[float] = []  # seconds of dead air inside replies
        self.first_audio_after: list[float] = []  # arrival of a reply's first frame
        self.close_code: int | None = None
        self.close_reason: str | None = None
        self._queued_ms = 0.0  # audio queued to play, from _play_clock on
        self._play_clock: float | None = None  # when the queued audio started playing
        self._pending: list[tuple[float, str]] = []  # (when it plays out, mark)
        self._last_frame_at: float | None = None
        self._ws = None
        self._tasks: list[asyncio.Task] = []
        self._changed = asyncio.Condition()  # notified on every message in and every mark echoed

    @property
    def call_id(self) -> str:
        """What the carrier calls this call (Twilio's callSid, Telnyx's call_control_id)."""
        return ("CA" + self.stream_id[2:]) if self.provider == "twilio" else "v3:" + self.stream_id

    def _key(self) -> dict:
        return {"streamSid": self.stream_id} if self.provider == "twilio" else {"stream_id": self.stream_id}

    async def __aenter__(self) -> "Phone":
        self._ws = await websockets.connect(self.url, max_size=2 ** 20, local_addr=(self.local_address, 0)
                                            if self.local_address else None)
        if self.provider == "twilio":
            start = {"event": "start", "sequenceNumber": "1", **self._key(), "start": {
                "accountSid": "AC0", "streamSid": self.stream_id, "callSid": self.call_id,
                "tracks": ["inbound"], "customParameters": self.parameters,
                "mediaFormat": {"encoding": "audio/x-mulaw", "sampleRate": 8000, "channels": 1}}}
        else:
            start = {"event": "start", "sequence_number": "1", **self._key(), "start": {
                "call_control_id": self.call_id, "custom_parameters": [
                    {"name": k, "value": v} for k, v in self.parameters.items()],
                "media_format": {"encoding": "PCMU", "sample_rate": 8000, "channels": 1}}}
        await self._send({"event": "connected", "protocol": "Call", "version": "1.0.0"})
        await self._send(start)
        self._tasks = [asyncio.create_task(self._read()), asyncio.create_task(self._echo_marks())]
        return self

    async def __aexit__(self, *exc) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self._ws.close()

    async def _send(self, msg: dict) -> None:
        await self._ws.send(json.dumps(msg))

    async def speak(self, frames: list[bytes], realtime: bool = True) -> float:
        """Send the caller's frames (at real time, as a phone does); returns when the last was sent."""
        started = time.monotonic()
        for i, frame in enumerate(frames):
            if realtime:
                await asyncio.sleep(max(0.0, started + i * FRAME_MS / 1000 - time.monotonic()))
            await self._send({"event": "media", **self._key(), "media": {
                "track": "inbound", "chunk": str(i), "timestamp": str(i * FRAME_MS),
                "payload": base64.b64encode(frame).decode()}})
        return time.monotonic()

    async def press(self, digit: str) -> None:
        await self._send({"event": "dtmf", **self._key(), "dtmf": {"track": "inbound_track", "digit": digit}})

    async def hang_up(self) -> None:
        await self._send({"event": "stop", **self._key(), "stop": {"accountSid": "AC0", "callSid": "CA0"}})

    # ------------------------------------------------------------------ the phone's playback
    def _played_out_at(self) -> float:
        return (self._play_clock or time.monotonic()) + self._queued_ms / 1000

    def _receive_media(self, data: bytes, now: float) -> None:
        if self._play_clock is None or now >= self._played_out_at():  # the queue ran dry
            if self._last_frame_at is not None and now - self._last_frame_at < REPLY_IDLE_S:
                self.gaps.append(now - self._played_out_at())  # inside a reply: dead air
            else:  # the first frame after a pause (or a clear): a reply begins
                self.first_audio_after.append(now)
            self._play_clock, self._queued_ms = now, 0.0
        self._queued_ms += len(data) / BYTES_PER_MS
        self._last_frame_at = now
        self.received.append((now, len(data)))

    def _receive_clear(self, now: float) -> None:
        """The queued audio is dropped and its marks echoed at once; the reply is over, so the
        next frame begins another (not dead air, however soon it comes)."""
        self.clears.append(now)
        self._play_clock, self._queued_ms, self._last_frame_at = None, 0.0, None
        self._pending = [(now, name) for _, name in self._pending]

    async def _read(self) -> None:
        try:
            async for frame in self._ws:
                msg, now = json.loads(frame), time.monotonic()
                if msg["event"] == "media":
                    self._receive_media(base64.b64decode(msg["media"]["payload"]), now)
                elif msg["event"] == "mark":
                    self.marks.append(msg["mark"]["name"])
                    self._pending.append((self._played_out_at(), msg["mark"]["name"]))
                elif msg["event"] == "clear":
                    self._receive_clear(now)
                await self._notify()
        except websockets.ConnectionClosed:
            pass  # a normal close ends the loop without it
        self.close_code, self.close_reason = self._ws.close_code, self._ws.close_reason
        await self._notify()

    async def _notify(self) -> None:
        async with self._changed:
            self._changed.notify_all()

    async def wait(self, pred, timeout: float = 60) -> None:
        """Until ``pred(self)`` holds (looked at on each message and echo)."""
        async with self._changed:
            await asyncio.wait_for(self._changed.wait_for(lambda: pred(self)), timeout)

    async def _echo_marks(self) -> None:
        while True:
            now = time.monotonic()
            due = [name for at, name in self._pending if at <= now]
            self._pending = [(at, name) for at, name in self._pending if at > now]
            for name in due:
                self.echoed.append(name)
                await self._send({"event": "mark", **self._key(), "mark": {"name": name}})
            if due:
                await self._notify()
            await asyncio.sleep(FRAME_MS / 1000)  # the phone's playback tick

    async def reply_heard(self, since: float, timeout: float = 60) -> None:
        """Until a reply that began after ``since`` has arrived whole (no audio for REPLY_IDLE_S)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            began = [t for t in self.first_audio_after if t > since]
            if began and self._last_frame_at is not None and time.monotonic() - self._last_frame_at >= REPLY_IDLE_S:
                return
            await asyncio.sleep(0.05)
        raise TimeoutError(f"no whole reply within {timeout} s: {self._describe(since)}")

    def _describe(self, since: float) -> str:
        """What came, relative to ``since`` (seconds): for a failure's message."""
        rel = lambda ts: [round(t - since, 2) for t in ts]  # noqa: E731
        last = None if self._last_frame_at is None else round(self._last_frame_at - since, 2)
        return (f"replies began at {rel(self.first_audio_after)}, clears at {rel(self.clears)}, "
                f"last frame at {last}, {len(self.received)} frames, {len(self.gaps)} gaps "
                f"(max {max(self.gaps, default=0):.2f} s), marks {self.marks[-3:]}")


async def call(url: str, turns: int, provider: str, speech_frames: list[list[bytes]], silence: list[bytes],
               token: str | None = None) -> dict:
    async with Phone(url, provider, {"ticket": token} if token else None) as phone:
        v2v = []
        for turn in range(turns):
            ended = await phone.speak(speech_frames[turn % len(speech_frames)])
            await phone.speak(silence)  # the caller stays on the line, quiet: the turn ends by itself
            await phone.reply_heard(ended)
            v2v.append(next(t for t in phone.first_audio_after if t > ended) - ended)
        await phone.hang_up()
        return {"gaps": phone.gaps, "v2v": v2v, "marks": len(phone.marks), "echoed": len(phone.echoed)}


def _pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else 0.0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", default=URL)
    ap.add_argument("--provider", default="twilio", choices=("twilio", "telnyx"))
    ap.add_argument("--calls", type=int, default=4)
    ap.add_argument("--turns", type=int, default=3)
    add_token_argument(ap)  # the stream's credential (its start's ticket parameter) where auth is on
    args = ap.parse_args(argv)
    frames = [ulaw_frames(speech.espeak(s)) for s in SENTENCES]
    silence = ulaw_frames(np.zeros(int(2.0 * 16_000), np.int16))

    async def run() -> list[dict]:
        return await asyncio.gather(*(call(args.url.replace("twilio", args.provider), args.turns, args.provider,
                                           frames[i:] + frames[:i], silence, args.token) for i in range(args.calls)))

    results = asyncio.run(run())
    gaps = [g for r in results for g in r["gaps"]]
    v2v = [v for r in results for v in r["v2v"]]
    row = {"calls": args.calls, "turns": args.calls * args.turns, "gap_p50_ms": 1000 * _pct(gaps, 50),
           "gap_p99_ms": 1000 * _pct(gaps, 99), "gap_max_ms": 1000 * max(gaps, default=0.0),
           "gaps_over_500ms": sum(g > 0.5 for g in gaps), "v2v_p50_ms": 1000 * statistics.median(v2v),
           "v2v_max_ms": 1000 * max(v2v), "marks": sum(r["marks"] for r in results),
           "marks_echoed": sum(r["echoed"] for r in results)}
    print(f"{'calls':>6} {'turns':>6} {'gap p50/p99/max ms':>22} {'>500ms':>7} {'v2v p50/max ms':>16}")
    print(f"{row['calls']:>6} {row['turns']:>6} {row['gap_p50_ms']:>7.0f}/{row['gap_p99_ms']:.0f}/"
          f"{row['gap_max_ms']:.0f}{'':>5} {row['gaps_over_500ms']:>7} {row['v2v_p50_ms']:>8.0f}/{row['v2v_max_ms']:.0f}")
    print(json.dumps({"benchmark": "phone", **row}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
