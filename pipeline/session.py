"""One conversation over the WebSocket protocol, independent of how the engines are served.

A :class:`Session` turns client frames into calls on a :class:`Backends` object (Ray
deployment handles in production, in-process engines in tests) and sends protocol
messages back through one ``send`` coroutine. All per-session state lives here, never in
globals: one session's bad frame, error or disconnect touches nothing another holds.

Turn flow: audio frames stream into STT (partials go out as ``transcript.partial``); the
user turn ends on ``turn.end`` or STT endpointing; its ``transcript.final`` goes out, then
a reply task streams LLM text (``response.text``), hands it to TTS clause by clause and
streams the audio (``audio``), ending with ``response.done``. A new user turn while a reply
is still running interrupts it (``response.done`` with ``interrupted: true``), and the
history keeps only what was actually said.
"""
from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import AsyncIterator, Awaitable, Callable, Protocol

import numpy as np

from pipeline import protocol as P
from pipeline.clauses import ClauseSplitter

log = logging.getLogger(__name__)


class NoFreeSlot(Exception):
    """The recogniser has no free slot for a new session."""


class Backends(Protocol):
    """What a session needs from the engines. Audio crosses as contiguous numpy arrays."""

    async def stt_open(self, sid: str) -> None: ...  # raises NoFreeSlot
    async def stt_push(self, sid: str, pcm: np.ndarray) -> list[dict]: ...  # [{"kind","text"}]
    async def stt_finish(self, sid: str) -> str: ...
    async def stt_close(self, sid: str) -> None: ...
    def llm_stream(self, messages: list[dict]) -> AsyncIterator[str]: ...
    def tts_stream(self, text: str) -> AsyncIterator[np.ndarray]: ...


@dataclass
class SessionConfig:
    # Audio may lead real time by at most this much (None: send as fast as it is made).
    pace_lead_s: float | None = 0.3
    clause_max_words: int = 12
    # Observers for metrics (the gateway wires them); called with seconds.
    on_chunk_gap: Callable[[float], None] | None = None
    on_first_audio: Callable[[float], None] | None = None
    on_turn: Callable[[], None] | None = None
    on_interrupt: Callable[[], None] | None = None
    on_error: Callable[[str], None] | None = None


@dataclass
class _Reply:
    turn: int
    task: asyncio.Task
    spoken: list[str] = field(default_factory=list)  # clauses whose audio started playing
    done_sent: bool = False


class Session:
    def __init__(
        self,
        send: Callable[[bytes], Awaitable[None]],
        backends: Backends,
        cfg: SessionConfig | None = None,
        session_id: str | None = None,
    ):
        self.id = session_id or uuid.uuid4().hex
        self.cfg = cfg or SessionConfig()
        self._send_raw = send
        self._send_lock = asyncio.Lock()
        self.backends = backends
        self.turn = 0  # number of the last user turn that ended
        self.listening = False  # audio of turn ``self.turn + 1`` has arrived and not ended
        self.partial = ""
        self.history: list[dict] = []
        self.reply: _Reply | None = None
        self._stt_open = False
        self.closed = False

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        """Take an STT slot and greet the client; raises :class:`NoFreeSlot`."""
        await self.backends.stt_open(self.id)
        self._stt_open = True
        await self.send(P.session_ready(self.id))

    async def close(self) -> None:
        """Cancel everything this session started and release its STT slot."""
        if self.closed:
            return
        self.closed = True
        await self._interrupt(send_done=False)
        if self._stt_open:
            self._stt_open = False
            try:
                await self.backends.stt_close(self.id)
            except Exception:  # noqa: BLE001 - closing must not raise
                log.exception("session %s: releasing the STT slot failed", self.id)

    async def send(self, msg: dict) -> None:
        if self.closed and msg.get("type") != "error":
            return
        async with self._send_lock:
            await self._send_raw(P.pack(msg))

    async def send_error(self, code: str, message: str) -> None:
        if self.cfg.on_error:
            self.cfg.on_error(code)
        await self.send(P.error(code, message))

    # ------------------------------------------------------------------ input
    async def on_frame(self, frame: bytes | str) -> None:
        """Handle one client frame. Bad input costs one ``error`` message, nothing more."""
        try:
            msg = P.parse_client_frame(frame)
        except P.ProtocolError as exc:
            await self.send_error(exc.code, exc.message)
            return
        if isinstance(msg, P.AudioIn):
            await self._on_audio(msg.pcm)
        elif isinstance(msg, P.TextIn):
            await self._end_turn(typed_text=msg.text)
        else:
            await self._end_turn()

    async def _on_audio(self, pcm: np.ndarray) -> None:
        if not self.listening:
            self.listening = True
            self.partial = ""
        events = await self.backends.stt_push(self.id, pcm)
        for ev in events:
            if ev["kind"] == "partial" and ev["text"]:
                self.partial += ev["text"]
                await self.send(P.transcript_partial(self.partial, self.turn + 1))
            elif ev["kind"] == "endpoint":
                await self._end_turn()
                break

    async def _end_turn(self, typed_text: str | None = None) -> None:
        """End the current user turn (spoken or typed) and start its reply."""
        ended_at = time.monotonic()
        if typed_text is not None and self.listening:
            await self._end_turn()  # spoken audio in flight becomes its own turn first
        await self._interrupt(send_done=True)
        if typed_text is not None:
            text = typed_text
        else:
            text = await self.backends.stt_finish(self.id) if self.listening else ""
        self.listening = False
        self.partial = ""
        self.turn += 1
        turn = self.turn
        await self.send(P.transcript_final(text, turn))
        if self.cfg.on_turn:
            self.cfg.on_turn()
        task = asyncio.create_task(self._run_reply(turn, text.strip(), ended_at), name=f"reply-{self.id}-{turn}")
        self.reply = _Reply(turn, task)

    async def _interrupt(self, send_done: bool) -> None:
        reply, self.reply = self.reply, None
        if reply is None or reply.task.done():
            return
        reply.task.cancel()
        try:
            await reply.task
        except asyncio.CancelledError:
            pass
        except Exception:  # noqa: BLE001 - the reply already reported its error
            pass
        said = " ".join(reply.spoken)
        if self.history and self.history[-1]["role"] == "user":
            self.history.append({"role": "assistant", "content": said})
        if self.cfg.on_interrupt:
            self.cfg.on_interrupt()
        if send_done and not reply.done_sent:
            reply.done_sent = True
            await self.send(P.response_done(reply.turn, interrupted=True))

    # ------------------------------------------------------------------ reply
    async def _run_reply(self, turn: int, text: str, ended_at: float) -> None:
        reply = self.reply
        assert reply is not None and reply.turn == turn
        if not text:
            reply.done_sent = True
            await self.send(P.response_done(turn, interrupted=False))
            return
        self.history.append({"role": "user", "content": text})
        clauses: asyncio.Queue[str | None] = asyncio.Queue()
        speaker = asyncio.create_task(self._speak(reply, clauses, ended_at))
        full = ""
        try:
            splitter = ClauseSplitter(max_words=self.cfg.clause_max_words)
            async for delta in self.backends.llm_stream(list(self.history)):
                if not delta:
                    continue
                full += delta
                await self.send(P.response_text(delta, turn))
                for clause in splitter.push(delta):
                    clauses.put_nowait(clause)
            for clause in splitter.flush():
                clauses.put_nowait(clause)
            clauses.put_nowait(None)
            await speaker
        except asyncio.CancelledError:
            speaker.cancel()
            await asyncio.gather(speaker, return_exceptions=True)
            raise
        except Exception as exc:  # noqa: BLE001 - a backend fault ends this reply only
            log.exception("session %s turn %d: reply failed", self.id, turn)
            speaker.cancel()
            await asyncio.gather(speaker, return_exceptions=True)
            await self.send_error(P.E_INTERNAL, f"reply to turn {turn} failed: {type(exc).__name__}")
        self.history.append({"role": "assistant", "content": full.strip()})
        reply.done_sent = True
        await self.send(P.response_done(turn, interrupted=False))

    async def _speak(self, reply: _Reply, clauses: asyncio.Queue, ended_at: float) -> None:
        seq = 0
        first_at = last_at = None
        audio_s = 0.0
        while (clause := await clauses.get()) is not None:
            started = False
            async for pcm in self.backends.tts_stream(clause):
                if not started:
                    reply.spoken.append(clause)
                    started = True
                now = time.monotonic()
                if first_at is None:
                    first_at = now
                    if self.cfg.on_first_audio:
                        self.cfg.on_first_audio(now - ended_at)
                elif self.cfg.pace_lead_s is not None:
                    ahead = audio_s - (now - first_at)
                    if ahead > self.cfg.pace_lead_s:
                        await asyncio.sleep(ahead - self.cfg.pace_lead_s)
                now = time.monotonic()
                if last_at is not None and self.cfg.on_chunk_gap:
                    self.cfg.on_chunk_gap(now - last_at)
                last_at = now
                await self.send(P.audio_out(pcm, reply.turn, seq))
                seq += 1
                audio_s += len(pcm) / P.OUTPUT_SAMPLE_RATE
