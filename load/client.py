"""An asyncio client for protocol v1, used by the talk tool, the gap and load tests and the tests.

It records, per turn, every message with its arrival time, so callers can check ordering,
measure time to first audio and the gaps between audio chunks.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import time
from dataclasses import dataclass, field

import numpy as np
import websockets

from pipeline import protocol as P


@dataclass
class TurnResult:
    turn: int
    final_text: str = ""
    partials: list[str] = field(default_factory=list)
    partial_times: list[float] = field(default_factory=list)
    response_text: str = ""
    chunks: list[np.ndarray] = field(default_factory=list)
    chunk_times: list[float] = field(default_factory=list)
    interrupted: bool | None = None
    timings: dict | None = None  # response.done's optional server-side split (ms)
    status: str | None = None  # Realtime protocol: the response's status (completed, cancelled, ...)
    types: list[str] = field(default_factory=list)  # message types in arrival order
    ended_at: float = 0.0  # when the client ended the turn (sent turn.end / text)
    final_at: float = 0.0
    done_at: float = 0.0
    output_rate: int = P.OUTPUT_SAMPLE_RATE  # of ``chunks`` (a Realtime session in G.711: 8000)

    @property
    def audio(self) -> np.ndarray:
        return np.concatenate(self.chunks) if self.chunks else np.zeros(0, np.int16)

    @property
    def audio_s(self) -> float:
        return sum(len(c) for c in self.chunks) / self.output_rate

    @property
    def time_to_first_audio(self) -> float | None:
        return self.chunk_times[0] - self.ended_at if self.chunk_times else None

    @property
    def gaps(self) -> list[float]:
        return list(np.diff(self.chunk_times)) if len(self.chunk_times) > 1 else []


TOKEN_ENV = "GAPLESS_TOKEN"  # a server with auth on (docs/protocol.md, "Authentication and limits")


def add_token_argument(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--token", default=os.environ.get(TOKEN_ENV),
                    help=f"bearer token for a server with auth on (default ${TOKEN_ENV}; the variable keeps "
                         "it out of the process list)")


class Conversation:
    """One WebSocket session. ``async with Conversation(url) as c: await c.say_text("hi")``.
    ``token`` goes in an ``Authorization: Bearer`` header; ``local_addr`` picks the client's own
    address (e.g. ``("127.0.0.2", 0)``: another client, to per-address limits)."""

    def __init__(self, url: str, max_size: int = 2**22, token: str | None = None,
                 local_addr: tuple[str, int] | None = None):
        self.url = url
        self.max_size = max_size
        self.token = token
        self.local_addr = local_addr
        self.ws = None
        self.ready: dict | None = None
        self.errors: list[dict] = []
        self.turns: dict[int, TurnResult] = {}
        self.closed: tuple[int | None, str | None] | None = None
        self._inbox: asyncio.Queue = asyncio.Queue()
        self._reader: asyncio.Task | None = None

    async def __aenter__(self) -> "Conversation":
        headers = {"Authorization": f"Bearer {self.token}"} if self.token else None
        extra = {"local_addr": self.local_addr} if self.local_addr else {}
        self.ws = await websockets.connect(self.url, max_size=self.max_size, additional_headers=headers, **extra)
        self._reader = asyncio.create_task(self._read())
        first = await self.next_message(timeout=30)
        if first["type"] != "session.ready":
            raise RuntimeError(f"expected session.ready, got {first}")
        self.ready = first
        return self

    async def __aexit__(self, *exc) -> None:
        await self.ws.close()
        if self._reader:
            self._reader.cancel()

    async def _read(self) -> None:
        try:
            async for frame in self.ws:
                now = time.monotonic()
                msg = P.unpack(frame) if isinstance(frame, bytes) else {"type": "<text frame>", "text": frame}
                self._record(msg, now)
                await self._inbox.put(msg)
        except websockets.ConnectionClosed:
            pass
        finally:
            self.closed = (self.ws.close_code, self.ws.close_reason)
            self._inbox.put_nowait({"type": "<closed>"})

    def _record(self, msg: dict, now: float) -> None:
        kind = msg["type"]
        if kind == "error":
            self.errors.append(msg)
            return
        turn = msg.get("turn")
        if turn is None:
            return
        tr = self.turns.setdefault(turn, TurnResult(turn))
        tr.types.append(kind)
        if kind == "transcript.partial":
            tr.partials.append(msg["text"])
            tr.partial_times.append(now)
        elif kind == "transcript.final":
            tr.final_text, tr.final_at = msg["text"], now
        elif kind == "response.text":
            tr.response_text += msg["text"]
        elif kind == "audio":
            tr.chunks.append(np.frombuffer(msg["pcm"], dtype="<i2"))
            tr.chunk_times.append(now)
        elif kind == "response.done":
            tr.interrupted, tr.done_at = msg["interrupted"], now
            tr.timings = msg.get("timings")

    async def next_message(self, timeout: float = 60) -> dict:
        return await asyncio.wait_for(self._inbox.get(), timeout)

    async def wait_for(self, pred, timeout: float = 120) -> dict:
        """Consume messages until one satisfies ``pred``; return it."""
        deadline = time.monotonic() + timeout
        while True:
            msg = await self.next_message(max(0.01, deadline - time.monotonic()))
            if pred(msg):
                return msg
            if msg["type"] == "<closed>":
                raise ConnectionError(f"connection closed: {self.closed}")

    async def send(self, frame: bytes | str) -> None:
        await self.ws.send(frame)

    async def send_audio(self, pcm: np.ndarray, chunk_ms: int = 100, realtime: bool = False) -> None:
        step = P.INPUT_SAMPLE_RATE * chunk_ms // 1000
        for i in range(0, len(pcm), step):
            await self.send(P.client_audio(pcm[i : i + step]))
            if realtime:
                await asyncio.sleep(chunk_ms / 1000)

    async def _finish_turn(self, turn: int, timeout: float) -> TurnResult:
        await self.wait_for(lambda m: m["type"] == "response.done" and m["turn"] == turn, timeout)
        return self.turns[turn]

    async def send_text_turn(self, text: str) -> int:
        """Send a typed turn without waiting for its response; returns its turn number."""
        turn = max(self.turns, default=0) + 1
        self.turns[turn] = TurnResult(turn, ended_at=time.monotonic())
        await self.send(P.client_text(text))
        return turn

    async def say_text(self, text: str, timeout: float = 120) -> TurnResult:
        turn = await self.send_text_turn(text)
        return await self._finish_turn(turn, timeout)

    async def say_audio(self, pcm: np.ndarray, chunk_ms: int = 100, realtime: bool = False, timeout: float = 120) -> TurnResult:
        turn = max(self.turns, default=0) + 1
        await self.send_audio(pcm, chunk_ms, realtime)
        self.turns.setdefault(turn, TurnResult(turn)).ended_at = time.monotonic()
        await self.send(P.client_turn_end())
        return await self._finish_turn(turn, timeout)

    async def say_hands_free(self, pcm: np.ndarray, speech_end: int, chunk_ms: int = 20, timeout: float = 60,
                             mic=None) -> TurnResult:
        """A hands-free spoken turn: ``pcm`` and then silence stream in real time, as a microphone
        delivers them (each frame when its last sample is captured), without turn.end, until the
        server has ended the turn and answered it. ``speech_end`` is the sample where the speech
        in ``pcm`` ends; the turn's ``ended_at`` is when that sample was spoken, so
        ``time_to_first_audio`` is voice-to-voice. ``mic(start, n)``, if given, adds to each frame
        (e.g. the echo of what plays, load/speakerphone.py)."""
        turn = max(self.turns, default=0) + 1
        step = P.INPUT_SAMPLE_RATE * chunk_ms // 1000
        t0 = time.monotonic()
        k = 0
        while not (turn in self.turns and self.turns[turn].done_at):
            if time.monotonic() - t0 > timeout:
                raise TimeoutError(f"turn {turn} was not ended and answered within {timeout} s")
            frame = np.zeros(step, np.float32)
            part = pcm[k:k + step]
            frame[: len(part)] = part
            if mic is not None:
                frame += mic(k, step)
            await asyncio.sleep(max(0.0, t0 + (k + step) / P.INPUT_SAMPLE_RATE - time.monotonic()))
            await self.send(P.client_audio(np.clip(frame, -32768, 32767).astype(np.int16)))
            k += step
        tr = self.turns[turn]
        tr.ended_at = t0 + speech_end / P.INPUT_SAMPLE_RATE
        await self.wait_for(lambda m: m["type"] == "response.done" and m.get("turn") == turn, timeout)
        return tr

