"""An asyncio client for protocol v1, used by the talk tool, the gap and load tests and the tests.

It records, per turn, every message with its arrival time, so callers can check ordering,
measure time to first audio and the gaps between audio chunks.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import time
import urllib.parse
from dataclasses import dataclass, field

import numpy as np
import websockets

from pipeline.adapters.v1 import protocol as P
from pipeline.audio_constants import REPLY_RATE, USER_RATE


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
    speech_stopped_at: float = 0.0  # hands-free: when the server's last speech.stopped before the final arrived
    final_at: float = 0.0
    done_at: float = 0.0
    output_rate: int = REPLY_RATE  # of ``chunks`` (a Realtime session in G.711: 8000)
    lost: bool = False  # sent, but the connection dropped before the server had it (resume)
    sent_text: str | None = None  # a typed turn's text (sent again if the server never had it)

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


# Close codes after which a resumable session reconnects (resume=True): the link dropped (1006:
# no close frame), or the server asked it to go on elsewhere (1012 after going_away; 1001).
RESUME_ON = (1006, 1012, 1001, 1011, None)
BACKOFF_S = (0.0, 0.1, 0.2, 0.5, 1.0, 2.0, 4.0)  # before each reconnection attempt, then 4 s each


@dataclass
class Resumed:
    """One reconnection: why the link ended, and how long until the session was back."""

    close_code: int | None
    dropped_at: float
    resumed_at: float | None = None  # None: refused or never reached
    attempts: int = 0
    refused: dict | None = None  # the server's resume_refused error

    @property
    def after_s(self) -> float | None:
        return None if self.resumed_at is None else self.resumed_at - self.dropped_at


class Conversation:
    """One WebSocket session. ``async with Conversation(url) as c: await c.say_text("hi")``.
    ``token`` goes in an ``Authorization: Bearer`` header; ``local_addr`` picks the client's own
    address (e.g. ``("127.0.0.2", 0)``: another client, to per-address limits). ``resume``: a
    dropped connection (or a draining server's ``going_away``) reconnects by itself, with backoff
    within the session's resume window, and resumes the session (docs/protocol.md, "Resume"):
    turns and messages go on as if nothing happened, and ``resumes`` records each one."""

    def __init__(self, url: str, max_size: int = 2**22, token: str | None = None,
                 local_addr: tuple[str, int] | None = None, resume: bool = False):
        self.url = url
        self.max_size = max_size
        self.token = token
        self.local_addr = local_addr
        self.resume = resume
        self.ws = None
        self.ready: dict | None = None
        self.errors: list[dict] = []
        self.turns: dict[int, TurnResult] = {}
        self.closed: tuple[int | None, str | None] | None = None
        self.resumes: list[Resumed] = []
        self.last_audio: tuple[int, int] | None = None  # (turn, seq) of the last audio message received
        self.speech_stopped_at = 0.0  # arrival of the last speech.stopped (the server's VAD)
        self._resume_token: str | None = None
        self._leaving = False  # the caller closes: no reconnection
        self._connected = asyncio.Event()
        self._inbox: asyncio.Queue = asyncio.Queue()
        self._reader: asyncio.Task | None = None

    async def _connect(self, url: str):
        headers = {"Authorization": f"Bearer {self.token}"} if self.token else None
        extra = {"local_addr": self.local_addr} if self.local_addr else {}
        return await websockets.connect(url, max_size=self.max_size, additional_headers=headers, **extra)

    async def __aenter__(self) -> "Conversation":
        self.ws = await self._connect(self.url)
        first = P.unpack(await asyncio.wait_for(self.ws.recv(), 30))
        if first["type"] != "session.ready":
            await self.ws.close()
            raise RuntimeError(f"expected session.ready, got {first}")
        self._ready(first)
        self._reader = asyncio.create_task(self._read())
        return self

    async def __aexit__(self, *exc) -> None:
        self._leaving = True
        await self.ws.close()
        if self._reader:
            self._reader.cancel()

    def _ready(self, msg: dict) -> None:
        self.ready = msg
        self._resume_token = msg.get("resume_token")
        self._connected.set()

    async def _read(self) -> None:
        try:
            while True:
                try:
                    async for frame in self.ws:
                        now = time.monotonic()
                        msg = P.unpack(frame) if isinstance(frame, bytes) else {"type": "<text frame>", "text": frame}
                        self._record(msg, now)
                        await self._inbox.put(msg)
                except websockets.ConnectionClosed:
                    pass
                if not await self._reconnect():
                    return
        finally:
            self.closed = (self.ws.close_code, self.ws.close_reason)
            self._connected.set()  # a sender waiting for the link hears of the close
            self._inbox.put_nowait({"type": "<closed>"})

    async def _reconnect(self) -> bool:
        """After the link ended: resume the session if it may be (True once resumed)."""
        code = self.ws.close_code
        if not (self.resume and self._resume_token and not self._leaving and code in RESUME_ON):
            return False
        self._connected.clear()
        record = Resumed(code, time.monotonic())
        self.resumes.append(record)
        window = float((self.ready or {}).get("resume_window_s", 30))
        while time.monotonic() - record.dropped_at < window and not self._leaving:
            await asyncio.sleep(BACKOFF_S[min(record.attempts, len(BACKOFF_S) - 1)])
            record.attempts += 1
            try:
                ws = await self._connect(self._resume_url())
                first = P.unpack(await asyncio.wait_for(ws.recv(), 30))
            except (OSError, asyncio.TimeoutError, websockets.InvalidHandshake, websockets.ConnectionClosed):
                continue  # the server is not there (yet): try again
            if first["type"] == "session.ready":
                self.ws, record.resumed_at = ws, time.monotonic()
                self._ready(first)
                await self._inbox.put({**first, "type": "<resumed>"})
                await self._end_cut_turns(first.get("turn", 0), record.resumed_at)
                return True
            await ws.close()
            if first.get("code") != P.E_SERVER_BUSY:  # resume_refused: the session is gone
                record.refused = first
                self.errors.append(first)
                return False
        return False

    async def _end_cut_turns(self, server_turn: int, now: float) -> None:
        """After a resume: a typed turn the server never had (after ``server_turn``: sent as the
        link went) is sent again, and keeps its number; any other turn whose response.done never
        came is over, interrupted, as a local ``response.done`` (``cut_by: "drop"``), and ``lost``
        if the server never had it (a spoken one)."""
        for turn, tr in sorted(self.turns.items()):
            if tr.done_at or not tr.ended_at:
                continue
            if turn > server_turn and tr.sent_text is not None:
                await self.ws.send(P.client_text(tr.sent_text))
                continue
            tr.interrupted, tr.done_at, tr.lost = True, now, turn > server_turn
            await self._inbox.put({"type": "response.done", "turn": turn, "interrupted": True, "cut_by": "drop"})

    def _resume_url(self) -> str:
        parts = urllib.parse.urlsplit(self.url)
        query = [(k, v) for k, v in urllib.parse.parse_qsl(parts.query) if not k.startswith("resume")]
        query.append(("resume", self._resume_token))
        if self.last_audio is not None:
            query += [("resume_turn", str(self.last_audio[0])), ("resume_seq", str(self.last_audio[1]))]
        return urllib.parse.urlunsplit(parts._replace(query=urllib.parse.urlencode(query)))

    def drop(self) -> None:
        """Cut the link as a network failure would: no close frame (tests and load tools)."""
        self.ws.transport.abort()

    def _record(self, msg: dict, now: float) -> None:
        kind = msg["type"]
        if kind == "error":
            self.errors.append(msg)
            return
        if kind == "going_away":
            self._resume_token = msg.get("resume_token") or self._resume_token
            return
        if kind == "speech.stopped":
            self.speech_stopped_at = now
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
            tr.speech_stopped_at = self.speech_stopped_at
        elif kind == "response.text":
            tr.response_text += msg["text"]
        elif kind == "audio":
            tr.chunks.append(np.frombuffer(msg["pcm"], dtype="<i2"))
            tr.chunk_times.append(now)
            self.last_audio = (turn, msg["seq"])
        elif kind == "response.done":
            tr.interrupted, tr.done_at = msg["interrupted"], now
            tr.timings = msg.get("timings")

    async def next_message(self, timeout: float = 60) -> dict:
        return await asyncio.wait_for(self._inbox.get(), timeout)

    async def update(self, **settings) -> dict:
        """``session.update`` with these agent settings (docs/protocol.md); its answer,
        ``session.updated`` or the ``error`` that refused them."""
        await self.send(P.pack({"type": "session.update", **settings}))
        return await self.wait_for(lambda m: m["type"] in ("session.updated", "error"), timeout=30)

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
        """Send on the link; while a resumable session reconnects, once it is back."""
        while True:
            await self._connected.wait()
            ws = self.ws
            try:
                await ws.send(frame)
                return
            except websockets.ConnectionClosed:
                if not self.resume or self.closed is not None:
                    raise
                if self.ws is ws:  # the reader has not seen the close yet
                    self._connected.clear()

    async def send_audio(self, pcm: np.ndarray, chunk_ms: int = 100, realtime: bool = False) -> None:
        step = USER_RATE * chunk_ms // 1000
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
        self.turns[turn] = TurnResult(turn, ended_at=time.monotonic(), sent_text=text)
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
        step = USER_RATE * chunk_ms // 1000
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
            await asyncio.sleep(max(0.0, t0 + (k + step) / USER_RATE - time.monotonic()))
            await self.send(P.client_audio(np.clip(frame, -32768, 32767).astype(np.int16)))
            k += step
        tr = self.turns[turn]
        tr.ended_at = t0 + speech_end / USER_RATE
        await self.wait_for(lambda m: m["type"] == "response.done" and m.get("turn") == turn, timeout)
        return tr

