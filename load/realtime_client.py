"""A Realtime-protocol client with the same interface as ``load.client.Conversation``, built on the
official ``openai`` SDK's realtime client (``AsyncOpenAI(base_url=...).realtime.connect``).

It holds push-to-talk conversations the way the load tools hold v1 ones: a typed turn is a user
message and ``response.create``; a spoken turn is audio appended and committed (turn detection
off), then ``response.create``. Every server event is recorded with its arrival time, per turn,
into the same :class:`~load.client.TurnResult` the v1 client fills, so the gap and load tools
measure both protocols alike. Audio goes up as ``audio/pcm`` 24 kHz (or G.711, ``audio_format``)
and comes back decoded to int16.
"""
from __future__ import annotations

import asyncio
import base64
import time
import warnings
from urllib.parse import urlsplit, urlunsplit

import numpy as np

from load.client import TurnResult
from pipeline.audio import float_to_int16, int16_to_float, resample
from pipeline.audio_constants import USER_RATE

with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    import audioop

FORMATS = {"pcm": ({"type": "audio/pcm", "rate": 24000}, 24000), "pcmu": ({"type": "audio/pcmu"}, 8000),
           "pcma": ({"type": "audio/pcma"}, 8000)}


def sdk_base_url(url: str) -> str:
    """``ws://HOST:PORT/v1/realtime`` (or any URL on that server) -> the SDK's ``http://HOST:PORT/v1``."""
    parts = urlsplit(url)
    scheme = {"ws": "http", "wss": "https"}.get(parts.scheme, parts.scheme)
    return urlunsplit((scheme, parts.netloc, "/v1", "", ""))


def encode(pcm_16k: np.ndarray, audio_format: str) -> bytes:
    """16 kHz int16 -> the wire format's bytes."""
    fmt, rate = FORMATS[audio_format]
    pcm = float_to_int16(resample(int16_to_float(pcm_16k), USER_RATE, rate)).tobytes()
    if audio_format == "pcmu":
        return audioop.lin2ulaw(pcm, 2)
    if audio_format == "pcma":
        return audioop.lin2alaw(pcm, 2)
    return pcm


def decode(data: bytes, audio_format: str) -> np.ndarray:
    """The wire format's bytes -> int16 at the format's rate."""
    if audio_format == "pcmu":
        data = audioop.ulaw2lin(data, 2)
    elif audio_format == "pcma":
        data = audioop.alaw2lin(data, 2)
    return np.frombuffer(data, dtype="<i2")


class RealtimeConversation:
    """``async with RealtimeConversation(url) as c: await c.say_text("hi")``; ``token`` is sent as the
    API key (``Authorization: Bearer``), as the SDK does. ``session`` is merged into the first
    ``session.update`` (turn detection is off unless it says otherwise)."""

    def __init__(self, url: str, token: str | None = None, model: str = "gapless", audio_format: str = "pcm",
                 session: dict | None = None):
        self.url, self.token, self.model, self.audio_format = url, token, model, audio_format
        self.output_rate = FORMATS[audio_format][1]
        self.session_settings = session or {}
        self.session: dict | None = None  # the last session.created / session.updated
        self.ready: dict | None = None
        self.errors: list[dict] = []
        self.turns: dict[int, TurnResult] = {}
        self.events: list[tuple[float, dict]] = []  # every server event (deltas without their payload)
        self._by_response: dict[str, int] = {}
        self._turn_of_next_response: int | None = None
        self._inbox: asyncio.Queue = asyncio.Queue()
        self._manager = None
        self.conn = None
        self._reader: asyncio.Task | None = None

    async def __aenter__(self) -> "RealtimeConversation":
        from openai import AsyncOpenAI

        client = AsyncOpenAI(api_key=self.token or "unused", base_url=sdk_base_url(self.url), max_retries=0)
        self._manager = client.realtime.connect(model=self.model)
        self.conn = await self._manager.__aenter__()
        self._reader = asyncio.create_task(self._read())
        self.ready = await self.wait_for(lambda e: e["type"] == "session.created", timeout=30)
        fmt = FORMATS[self.audio_format][0]
        session = {"type": "realtime", "audio": {"input": {"format": fmt, "turn_detection": None},
                                                 "output": {"format": fmt}}}
        await self.update(_merge(session, self.session_settings))
        return self

    async def __aexit__(self, *exc) -> None:
        if self._reader:
            self._reader.cancel()
        await self._manager.__aexit__(None, None, None)

    async def update(self, session: dict) -> dict:
        await self.send({"type": "session.update", "session": session})
        return await self.wait_for(lambda e: e["type"] in ("session.updated", "error"), timeout=30)

    async def _read(self) -> None:
        try:
            async for event in self.conn:
                now = time.monotonic()
                ev = event.to_dict() if hasattr(event, "to_dict") else dict(event)
                self._record(ev, now)
                await self._inbox.put(ev)
        except Exception as exc:  # noqa: BLE001 - the connection ended (closed, refused, broken)
            self._inbox.put_nowait({"type": "<closed>", "reason": repr(exc)})
            return
        self._inbox.put_nowait({"type": "<closed>", "reason": "closed"})

    def _record(self, ev: dict, now: float) -> None:
        kind = ev["type"]
        self.events.append((now, {k: v for k, v in ev.items() if k != "delta"}))
        if kind == "error":
            self.errors.append(ev["error"])
            return
        if kind in ("session.created", "session.updated"):
            self.session = ev["session"]
        if kind == "response.created" and self._turn_of_next_response is not None:
            self._by_response[ev["response"]["id"]] = self._turn_of_next_response
            self._turn_of_next_response = None
        turn = self._by_response.get(ev.get("response_id") or (ev.get("response") or {}).get("id") or "")
        if kind == "conversation.item.input_audio_transcription.completed" and self._turn_of_next_response:
            turn = self._turn_of_next_response
            self.turns[turn].final_text, self.turns[turn].final_at = ev["transcript"], now
        if turn is None:
            return
        tr = self.turns[turn]
        tr.types.append(kind)
        if kind in ("response.output_audio_transcript.delta", "response.output_text.delta"):
            tr.response_text += ev["delta"]
        elif kind == "response.output_audio.delta":
            tr.chunks.append(decode(base64.b64decode(ev["delta"]), self.audio_format))
            tr.chunk_times.append(now)
        elif kind == "response.done":
            tr.interrupted, tr.done_at = ev["response"]["status"] == "cancelled", now
            tr.status = ev["response"]["status"]

    async def next_message(self, timeout: float = 60) -> dict:
        return await asyncio.wait_for(self._inbox.get(), timeout)

    async def wait_for(self, pred, timeout: float = 120) -> dict:
        """Consume events until one satisfies ``pred``; return it."""
        deadline = time.monotonic() + timeout
        while True:
            ev = await self.next_message(max(0.01, deadline - time.monotonic()))
            if pred(ev):
                return ev
            if ev["type"] == "<closed>":
                raise ConnectionError(f"connection closed: {ev['reason']}")

    async def send(self, event: dict) -> None:
        await self.conn.send(event)

    def _chunk_bytes(self, chunk_ms: int) -> int:
        return FORMATS[self.audio_format][1] * chunk_ms // 1000 * (2 if self.audio_format == "pcm" else 1)

    async def send_audio(self, pcm_16k: np.ndarray, chunk_ms: int = 100, realtime: bool = False) -> None:
        """The clip in the wire format (converted whole, then cut), ``chunk_ms`` an append."""
        data, step = encode(pcm_16k, self.audio_format), self._chunk_bytes(chunk_ms)
        for i in range(0, len(data), step):
            await self.send({"type": "input_audio_buffer.append",
                             "audio": base64.b64encode(data[i:i + step]).decode("ascii")})
            if realtime:
                await asyncio.sleep(chunk_ms / 1000)

    async def speak(self, pcm_16k: np.ndarray, until, chunk_ms: int = 20, timeout: float = 60) -> float:
        """Stream ``pcm_16k`` and then silence at real-time pace (each frame when its last sample is
        captured, as a microphone delivers it) until ``until()`` is true; returns when the speech
        ended (monotonic). For hands-free turns: the server's VAD ends them."""
        step = self._chunk_bytes(chunk_ms)
        speech, silence = encode(pcm_16k, self.audio_format), encode(np.zeros(16 * chunk_ms, np.int16), self.audio_format)
        t0 = time.monotonic()
        k = 0
        while not until():
            if time.monotonic() - t0 > timeout:
                raise TimeoutError(f"nothing satisfied the wait within {timeout} s of speaking")
            frame = speech[k * step:(k + 1) * step] or silence[:step]
            await asyncio.sleep(max(0.0, t0 + (k + 1) * chunk_ms / 1000 - time.monotonic()))
            await self.send({"type": "input_audio_buffer.append", "audio": base64.b64encode(frame).decode("ascii")})
            k += 1
        return t0 + len(pcm_16k) / USER_RATE

    def seen(self, kind: str, **fields) -> list[dict]:
        """The events of ``kind`` received so far whose fields equal ``fields``."""
        return [ev for _, ev in self.events if ev["type"] == kind and all(ev.get(k) == v for k, v in fields.items())]

    def _new_turn(self) -> TurnResult:
        turn = max(self.turns, default=0) + 1
        self.turns[turn] = tr = TurnResult(turn, output_rate=self.output_rate)
        self._turn_of_next_response = turn
        return tr

    async def _respond(self, tr: TurnResult, timeout: float) -> TurnResult:
        tr.ended_at = tr.ended_at or time.monotonic()
        await self.send({"type": "response.create"})
        await self.wait_for(lambda e: e["type"] == "response.done" and tr.done_at, timeout)
        return tr

    async def say_text(self, text: str, timeout: float = 120) -> TurnResult:
        tr = self._new_turn()
        tr.final_text = text
        await self.send({"type": "conversation.item.create",
                         "item": {"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}})
        return await self._respond(tr, timeout)

    async def say_audio(self, pcm: np.ndarray, chunk_ms: int = 100, realtime: bool = False,
                        timeout: float = 120) -> TurnResult:
        tr = self._new_turn()
        await self.send_audio(pcm, chunk_ms, realtime)
        tr.ended_at = time.monotonic()  # as v1's turn.end: time to first audio counts from here
        await self.send({"type": "input_audio_buffer.commit"})
        await self.wait_for(lambda e: e["type"] in ("conversation.item.input_audio_transcription.completed", "error"),
                            timeout)
        return await self._respond(tr, timeout)


def _merge(base: dict, update: dict) -> dict:
    out = dict(base)
    for key, value in update.items():
        out[key] = _merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out
