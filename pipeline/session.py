"""One conversation over the WebSocket protocol, independent of how the engines are served.

A :class:`Session` turns client frames into calls on a :class:`Backends` object (Ray
deployment handles in production, in-process engines in tests) and sends protocol
messages back through one ``send`` coroutine. All per-session state lives here, never in
globals: one session's bad frame, error or disconnect touches nothing another holds.

Turn flow: audio frames stream into STT (partials go out as ``transcript.partial``); the
user turn ends on ``turn.end`` or STT endpointing; its ``transcript.final`` goes out, then
a reply task streams LLM text (``response.text``), hands it to TTS clause by clause and
streams the audio (``audio``), paced to a small lead over real time, ending with
``response.done``. A new user turn, or user speech while a reply plays (barge-in), interrupts
the reply (``response.done`` with ``interrupted: true``), and the history keeps only what
was actually said. The TTS gets the conversation so far as CSM context: user turns' audio
encoded once, bot turns' generated codes, inside a bounded number of segments.
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
from pipeline.tts.prompt import Segment

log = logging.getLogger(__name__)

USER_SPEAKER = 1


class NoFreeSlot(Exception):
    """The recogniser has no free slot for a new session."""


class Backends(Protocol):
    """What a session needs from the engines. Audio crosses as contiguous numpy arrays."""

    async def stt_open(self, sid: str) -> None: ...  # raises NoFreeSlot
    async def stt_push(self, sid: str, pcm: np.ndarray) -> list[dict]: ...  # [{"kind","text"}]
    async def stt_finish(self, sid: str) -> tuple[str, list[dict]]: ...  # (text, words with times)
    async def stt_close(self, sid: str) -> None: ...
    def llm_stream(self, messages: list[dict]) -> AsyncIterator[str]: ...
    # (int16 24 kHz chunk, Mimi codes [n, 32] of the frames that made it)
    def tts_stream(self, text: str, context: list[Segment]) -> AsyncIterator[tuple[np.ndarray, np.ndarray]]: ...
    async def tts_encode(self, pcm: np.ndarray) -> np.ndarray: ...  # int16 16 kHz -> codes [T, 32]


@dataclass
class SessionConfig:
    # Audio may lead real time by at most this much (None: send as fast as it is made).
    pace_lead_s: float | None = 0.3
    clause_max_words: int = 12
    # Barge-in: user speech while a reply plays interrupts it once the recogniser hears words
    # (a non-empty partial) in audio louder than the noise floor, after the reply's first moments.
    barge_in: bool = True
    barge_in_min_rms: float = 0.01  # of int16 full scale; quieter audio never interrupts
    barge_in_grace_s: float = 0.5  # no interruption during the reply's first audio (echo)
    # CSM context: the last N turns with audio (user audio encoded once, bot codes as generated).
    context_turns: int = 6
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
    codes: list[np.ndarray] = field(default_factory=list)  # codes of the audio sent
    first_audio_at: float | None = None
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
        self._turn_audio: list[np.ndarray] = []
        self._turn_loud = False
        self.history: list[dict] = []  # chat messages for the LLM
        self.context: list[Segment] = []  # CSM context, oldest first
        self.timings: dict[int, dict[str, float]] = {}  # per turn, ms after transcript.final
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
            self._turn_audio = []
            self._turn_loud = False
        self._turn_audio.append(pcm)
        if not self._turn_loud:
            rms = float(np.sqrt(np.mean(np.square(pcm.astype(np.float32) / 32768.0))))
            self._turn_loud = rms >= self.cfg.barge_in_min_rms
        events = await self.backends.stt_push(self.id, pcm)
        for ev in events:
            if ev["kind"] == "partial" and ev["text"]:
                self.partial += ev["text"]
                if self.partial.strip() and self._should_barge_in():
                    await self._interrupt(send_done=True)
                await self.send(P.transcript_partial(self.partial, self.turn + 1))
            elif ev["kind"] == "endpoint":
                await self._end_turn()
                break

    def _should_barge_in(self) -> bool:
        reply = self.reply
        if not self.cfg.barge_in or reply is None or reply.task.done() or not self._turn_loud:
            return False
        if reply.first_audio_at is None:
            return True  # nothing played yet: the user simply talks on
        return time.monotonic() - reply.first_audio_at >= self.cfg.barge_in_grace_s

    async def _end_turn(self, typed_text: str | None = None) -> None:
        """End the current user turn (spoken or typed) and start its reply."""
        ended_at = time.monotonic()
        if typed_text is not None and self.listening:
            await self._end_turn()  # spoken audio in flight becomes its own turn first
        await self._interrupt(send_done=True)
        user_audio, words = None, None
        if typed_text is not None:
            text = typed_text
        elif self.listening:
            text, words = await self.backends.stt_finish(self.id)
            user_audio = np.concatenate(self._turn_audio) if self._turn_audio else None
        else:
            text = ""
        self.listening = False
        self.partial = ""
        self._turn_audio = []
        self.turn += 1
        turn = self.turn
        await self.send(P.transcript_final(text, turn, words))
        if self.cfg.on_turn:
            self.cfg.on_turn()
        task = asyncio.create_task(
            self._run_reply(turn, text.strip(), user_audio, ended_at), name=f"reply-{self.id}-{turn}"
        )
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
        self._remember_bot_turn(reply, " ".join(reply.spoken))
        if self.cfg.on_interrupt:
            self.cfg.on_interrupt()
        if send_done and not reply.done_sent:
            reply.done_sent = True
            await self.send(P.response_done(reply.turn, interrupted=True))

    def _remember_bot_turn(self, reply: _Reply, said: str) -> None:
        """History and TTS context keep what was actually said (and its generated codes)."""
        if self.history and self.history[-1]["role"] == "user":
            self.history.append({"role": "assistant", "content": said})
        if reply.codes and said:
            self._add_context(Segment(0, said, np.concatenate(reply.codes)))

    def _add_context(self, seg: Segment) -> None:
        self.context.append(seg)
        del self.context[: -self.cfg.context_turns]

    # ------------------------------------------------------------------ reply
    async def _run_reply(self, turn: int, text: str, user_audio: np.ndarray | None, ended_at: float) -> None:
        reply = self.reply
        assert reply is not None and reply.turn == turn
        if not text:
            reply.done_sent = True
            await self.send(P.response_done(turn, interrupted=False))
            return
        final_at = time.monotonic()
        marks = self.timings.setdefault(turn, {})
        self.history.append({"role": "user", "content": text})
        # The user's audio is encoded once, beside the LLM's first tokens, for the TTS context.
        encoding = asyncio.create_task(self._encode_user_turn(text, user_audio)) if user_audio is not None else None
        clauses: asyncio.Queue[str | None] = asyncio.Queue()
        speaker = asyncio.create_task(self._speak(reply, clauses, encoding, ended_at, final_at, marks))
        full = ""
        try:
            splitter = ClauseSplitter(max_words=self.cfg.clause_max_words)
            async for delta in self.backends.llm_stream(list(self.history)):
                if not delta:
                    continue
                if not full:
                    marks["llm_first_token_ms"] = 1000 * (time.monotonic() - final_at)
                full += delta
                await self.send(P.response_text(delta, turn))
                for clause in splitter.push(delta):
                    marks.setdefault("first_clause_ms", 1000 * (time.monotonic() - final_at))
                    clauses.put_nowait(clause)
            for clause in splitter.flush():
                marks.setdefault("first_clause_ms", 1000 * (time.monotonic() - final_at))
                clauses.put_nowait(clause)
            clauses.put_nowait(None)
            await speaker
        except asyncio.CancelledError:
            speaker.cancel()
            await asyncio.gather(speaker, return_exceptions=True)
            if encoding:
                encoding.cancel()
            raise
        except Exception as exc:  # noqa: BLE001 - a backend fault ends this reply only
            log.exception("session %s turn %d: reply failed", self.id, turn)
            speaker.cancel()
            await asyncio.gather(speaker, return_exceptions=True)
            await self.send_error(P.E_INTERNAL, f"reply to turn {turn} failed: {type(exc).__name__}")
        self._remember_bot_turn(reply, full.strip())
        reply.done_sent = True
        await self.send(P.response_done(turn, interrupted=False, timings=marks))

    async def _encode_user_turn(self, text: str, pcm: np.ndarray) -> None:
        try:
            codes = await self.backends.tts_encode(pcm)
        except Exception:  # noqa: BLE001 - context is an improvement, never a failure
            log.exception("session %s: encoding user audio failed", self.id)
            return
        if len(codes):
            self._add_context(Segment(USER_SPEAKER, text, codes))

    async def _speak(self, reply: _Reply, clauses: asyncio.Queue, encoding: asyncio.Task | None,
                     ended_at: float, final_at: float, marks: dict) -> None:
        seq = 0
        last_at = None
        audio_s = 0.0
        while (clause := await clauses.get()) is not None:
            if encoding is not None:
                await encoding  # the user's turn joins the context before the first clause
                encoding = None
            context = list(self.context)
            if reply.codes:  # earlier clauses of this reply continue the same voice
                context.append(Segment(0, " ".join(reply.spoken), np.concatenate(reply.codes)))
            started = False
            async for pcm, codes in self.backends.tts_stream(clause, context):
                if not started:
                    reply.spoken.append(clause)
                    started = True
                now = time.monotonic()
                if reply.first_audio_at is None:
                    reply.first_audio_at = now
                    marks["first_audio_ms"] = 1000 * (now - final_at)
                    if self.cfg.on_first_audio:
                        self.cfg.on_first_audio(now - ended_at)
                elif self.cfg.pace_lead_s is not None:
                    ahead = audio_s - (now - reply.first_audio_at)
                    if ahead > self.cfg.pace_lead_s:
                        await asyncio.sleep(ahead - self.cfg.pace_lead_s)
                now = time.monotonic()
                if last_at is not None and self.cfg.on_chunk_gap:
                    self.cfg.on_chunk_gap(now - last_at)
                last_at = now
                await self.send(P.audio_out(pcm, reply.turn, seq))
                reply.codes.append(codes)
                seq += 1
                audio_s += len(pcm) / P.OUTPUT_SAMPLE_RATE
