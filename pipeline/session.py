"""One conversation over the WebSocket protocol, independent of how the engines are served.

A :class:`Session` turns client frames into calls on a :class:`Backends` object (Ray
deployment handles in production, in-process engines in tests) and sends protocol
messages back through one ``send`` coroutine. All per-session state lives here, never in
globals: one session's bad frame, error or disconnect touches nothing another holds.

Turn flow: audio frames stream into STT (partials go out as ``transcript.partial``); the
user turn ends on ``turn.end``, STT endpointing or the ``max_turn_s`` cap; its ``transcript.final`` goes out, then
a reply task streams LLM text (``response.text``), hands it to TTS clause by clause and
streams the audio (``audio``), paced to a small lead over real time, ending with
``response.done``. A new user turn, or user speech while a reply plays (barge-in), interrupts
the reply (``response.done`` with ``interrupted: true``), and the history keeps only what
was actually said. The TTS gets the conversation so far as CSM context: user turns' audio
encoded once, bot turns' generated codes, inside a bounded number of segments.

A session holds an STT slot only during a spoken turn: from the turn's first audio frame to its
end (final transcript, a typed turn, the time cap, or close). Idle or typing sessions hold
none, so open sockets never lock speakers out; a turn that finds every slot busy is told so
once (``no_free_slot``), its audio is dropped, and a later frame of it tries again.

Engines fail without taking the session with them: every engine call, and every item of an
engine stream, must answer within ``engine_timeout_s`` or the call fails as
:class:`EngineUnavailable` (so does a replica that died under it). The client then gets one
``engine_unavailable`` error: a spoken turn loses its audio so far (later frames of it try for a
slot again), a reply ends with ``response.done``; the session stays open for its next turn. An
STT replica that does not know the turn's stream (its routing key moved to another replica)
raises :class:`UnknownStream`: the turn restarts there, replaying its audio so far.
"""
from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import AsyncIterator, Awaitable, Callable, Protocol, TypeVar

import numpy as np

from pipeline import protocol as P
from pipeline.clauses import ClauseSplitter
from pipeline.tts.prompt import Segment

log = logging.getLogger(__name__)

USER_SPEAKER = 1
T = TypeVar("T")


class NoFreeSlot(Exception):
    """The recogniser has no free slot for a new spoken turn."""


class EngineUnavailable(Exception):
    """An engine did not answer within ``engine_timeout_s``, or the replica serving it is gone."""


class UnknownStream(Exception):
    """The STT replica that got a call holds no stream of that id (it was never opened there, or
    the replica that held it was replaced): never a silent loss, the session restarts the turn."""


class Backends(Protocol):
    """What a session needs from the engines. Audio crosses as contiguous numpy arrays.

    One STT stream per spoken turn: ``stt_open`` takes a slot, ``stt_finish`` returns the turn's
    transcript and gives the slot back, ``stt_close`` gives it back without one (idempotent)."""

    # Any call may raise EngineUnavailable; stt_push and stt_finish raise UnknownStream.
    async def stt_open(self, sid: str) -> None: ...  # raises NoFreeSlot; reopening an open sid restarts it
    async def stt_push(self, sid: str, pcm: np.ndarray) -> list[dict]: ...  # [{"kind","text"}]
    async def stt_finish(self, sid: str) -> tuple[str, list[dict]]: ...  # (text, words with times); frees the slot
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
    # Limits (docs/protocol.md, "Session limits"). No frame either way for this long closes the
    # session (idle_timeout, close 1000).
    idle_timeout_s: float = 300.0
    # A spoken turn ends (turn_too_long, then its transcript) once its recognised audio reaches this
    # length, or this long after it took its STT slot: bounds the buffered audio and the slot's hold.
    max_turn_s: float = 60.0
    # Sessions per gateway replica; a connection over the cap gets server_busy (close 1013).
    max_sessions: int = 64
    # A turn refused an STT slot tries again on a later audio frame, no sooner than this after.
    slot_retry_s: float = 1.0
    # An engine call, or the next item of an engine stream, that takes longer fails with
    # engine_unavailable (a dead or unreachable replica is never heard as silence).
    engine_timeout_s: float = 1.5
    # Observers for metrics (the gateway wires them); called with seconds.
    on_chunk_gap: Callable[[float], None] | None = None
    on_first_audio: Callable[[float], None] | None = None
    on_turn: Callable[[], None] | None = None
    on_interrupt: Callable[[], None] | None = None
    on_error: Callable[[str], None] | None = None

    def __post_init__(self) -> None:
        for name in ("idle_timeout_s", "max_turn_s", "max_sessions", "engine_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"SessionConfig.{name} must be > 0, got {getattr(self, name)!r}")
        if self.slot_retry_s < 0:
            raise ValueError(f"SessionConfig.slot_retry_s must be >= 0, got {self.slot_retry_s!r}")


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
        self._turn_audio: list[np.ndarray] = []  # the open turn's recognised audio, at most max_turn_s
        self._turn_samples = 0  # samples in _turn_audio
        self._max_turn_samples = max(1, int(self.cfg.max_turn_s * P.INPUT_SAMPLE_RATE))
        self._turn_loud = False
        self._holds_slot = False  # an STT slot may be held for the open turn (close() releases it)
        self._slot_taken_at = 0.0  # when the open turn got its slot (the max_turn_s clock)
        self._refused_at: float | None = None  # last refusal of the open turn's slot; None: not refused
        self._last_activity_at = time.monotonic()  # last frame either way (the idle clock)
        self.history: list[dict] = []  # chat messages for the LLM
        self.context: list[Segment] = []  # CSM context, oldest first
        self.timings: dict[int, dict[str, float]] = {}  # per turn, ms after transcript.final
        self.reply: _Reply | None = None
        self.closed = False

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        """Greet the client. Nothing is taken from the engines until a spoken turn starts."""
        await self.send(P.session_ready(self.id))

    async def close(self) -> None:
        """Cancel everything this session started and release an STT slot its open turn holds."""
        if self.closed:
            return
        self.closed = True
        await self._interrupt(send_done=False)
        await self._release_slot()

    async def send(self, msg: dict) -> None:
        if self.closed and msg.get("type") != "error":
            return
        async with self._send_lock:
            await self._send_raw(P.pack(msg))
        self._last_activity_at = time.monotonic()

    async def send_error(self, code: str, message: str) -> None:
        if self.cfg.on_error:
            self.cfg.on_error(code)
        await self.send(P.error(code, message))

    # ------------------------------------------------------------------ input
    async def on_frame(self, frame: bytes | str) -> None:
        """Handle one client frame. Bad input costs one ``error`` message, nothing more."""
        self._last_activity_at = time.monotonic()
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
        """Audio of the open spoken turn, or the first of a new one. The frame that brings a turn to
        max_turn_s ends it there (turn_too_long); the rest of that frame starts the next turn."""
        while pcm.size:
            if not self.listening:
                await self._begin_turn()
            elif not self._holds_slot:
                await self._retry_slot()
            if not self._holds_slot:
                return  # a refused turn: its audio is dropped
            room = self._max_turn_samples - self._turn_samples
            await self._recognise(pcm[:room])
            pcm = pcm[room:]
            if self.listening and self._turn_samples >= self._max_turn_samples:
                await self._end_long_turn()

    async def _begin_turn(self) -> None:
        self.listening = True
        self.partial = ""
        self._turn_audio = []
        self._turn_samples = 0
        self._turn_loud = False
        self._refused_at = None
        await self._take_slot()

    async def _take_slot(self) -> None:
        """Take an STT slot for the open turn. Refused, the client hears it once per turn, the
        turn's audio is dropped, and a later frame of it tries again (``_retry_slot``)."""
        self._holds_slot = True  # set first: if this call is cancelled midway, close() still releases
        try:
            await self._engine(self.backends.stt_open(self.id))
        except NoFreeSlot as exc:
            await self._lose_slot(P.E_NO_FREE_SLOT, f"{exc}; this turn's audio is dropped until a slot frees "
                                  "(the session stays open: speak on, speak again later, or type)")
            return
        except EngineUnavailable as exc:
            await self._lose_slot(P.E_ENGINE_UNAVAILABLE, f"the recogniser is unavailable ({exc}); this turn's "
                                  "audio is dropped until it answers (the session stays open)")
            return
        self._refused_at = None
        self._slot_taken_at = time.monotonic()

    async def _lose_slot(self, code: str, message: str) -> None:
        """The open turn has no recogniser stream (refused, or lost with its replica): its audio so
        far is dropped, the client is told once per turn, a later frame tries again."""
        self._holds_slot = False
        self.partial = ""
        self._turn_audio = []
        self._turn_samples = 0
        first_refusal = self._refused_at is None
        self._refused_at = time.monotonic()
        if first_refusal:
            await self.send_error(code, message)

    async def _retry_slot(self) -> None:
        """A refused turn asks again at most every ``slot_retry_s``, so hands-free clients recover."""
        if time.monotonic() - self._refused_at >= self.cfg.slot_retry_s:
            await self._take_slot()

    async def _release_slot(self) -> None:
        if not self._holds_slot:
            return
        self._holds_slot = False
        try:
            await self._engine(self.backends.stt_close(self.id))
        except EngineUnavailable as exc:  # a replica that went away took the slot with it
            log.warning("session %s: releasing the STT slot: %s", self.id, exc)
        except Exception:  # noqa: BLE001 - releasing must not raise
            log.exception("session %s: releasing the STT slot failed", self.id)

    # ------------------------------------------------------------------ engine calls
    async def _engine(self, call: Awaitable[T]) -> T:
        """One engine call, bounded by ``engine_timeout_s``."""
        try:
            return await asyncio.wait_for(call, self.cfg.engine_timeout_s)
        except asyncio.TimeoutError:
            raise EngineUnavailable(f"no answer within {self.cfg.engine_timeout_s:g} s") from None

    async def _engine_stream(self, stream: AsyncIterator[T]) -> AsyncIterator[T]:
        """An engine stream whose every next item must come within ``engine_timeout_s``."""
        try:
            while True:
                try:
                    item = await asyncio.wait_for(anext(stream), self.cfg.engine_timeout_s)
                except StopAsyncIteration:
                    return
                except asyncio.TimeoutError:
                    raise EngineUnavailable(f"no next item within {self.cfg.engine_timeout_s:g} s") from None
                yield item
        finally:
            await stream.aclose()

    async def _restart_stream(self) -> list[dict]:
        """The STT replica lost the turn's stream: open it again (wherever its key routes now) and
        replay the turn's audio so far; returns the replay's events. The partial transcript is
        rebuilt from them. Any failure here loses the turn (EngineUnavailable)."""
        log.warning("session %s: the recogniser does not know this turn's stream; restarting it", self.id)
        self.partial = ""
        try:
            await self._engine(self.backends.stt_open(self.id))
            audio = np.concatenate(self._turn_audio) if self._turn_audio else np.zeros(0, np.int16)
            return await self._engine(self.backends.stt_push(self.id, audio))
        except (NoFreeSlot, UnknownStream) as exc:
            raise EngineUnavailable(f"restarting the turn's stream failed: {exc}") from None

    async def _recognise(self, pcm: np.ndarray) -> None:
        self._turn_audio.append(pcm)
        self._turn_samples += len(pcm)
        if not self._turn_loud:
            rms = float(np.sqrt(np.mean(np.square(pcm.astype(np.float32) / 32768.0))))
            self._turn_loud = rms >= self.cfg.barge_in_min_rms
        try:
            try:
                events = await self._engine(self.backends.stt_push(self.id, pcm))
            except UnknownStream:
                events = await self._restart_stream()
        except EngineUnavailable as exc:
            await self._lose_slot(P.E_ENGINE_UNAVAILABLE, f"the recogniser failed mid-turn ({exc}); this turn's "
                                  "audio so far is lost (the session stays open; speak again)")
            return
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

    async def _end_long_turn(self) -> None:
        await self.send_error(P.E_TURN_TOO_LONG, f"a spoken turn lasts at most {self.cfg.max_turn_s:g} s; "
                              "it ends here as if turn.end had arrived")
        await self._end_turn()

    async def _end_turn(self, typed_text: str | None = None) -> None:
        """End the current user turn (spoken or typed) and start its reply."""
        ended_at = time.monotonic()
        if self.listening and not self._holds_slot:
            self._drop_turn()  # refused: nothing was heard, so nothing is sent and no number is used
            if typed_text is None:
                return
        if typed_text is not None and self.listening:
            await self._end_turn()  # spoken audio in flight becomes its own turn first
        await self._interrupt(send_done=True)
        user_audio, words = None, None
        if typed_text is not None:
            text = typed_text
        elif self.listening:
            try:
                text, words = await self._finish_stream()  # gives the slot back
            except EngineUnavailable as exc:
                self._drop_turn()  # nothing to answer: no turn number is used
                await self.send_error(P.E_ENGINE_UNAVAILABLE, f"the recogniser did not finish this turn ({exc}); "
                                      "its audio is lost (the session stays open; speak again)")
                return
            user_audio = np.concatenate(self._turn_audio) if self._turn_audio else None
        else:
            text = ""
        self._drop_turn()
        self.turn += 1
        turn = self.turn
        await self.send(P.transcript_final(text, turn, words))
        if self.cfg.on_turn:
            self.cfg.on_turn()
        task = asyncio.create_task(
            self._run_reply(turn, text.strip(), user_audio, ended_at), name=f"reply-{self.id}-{turn}"
        )
        self.reply = _Reply(turn, task)

    async def _finish_stream(self) -> tuple[str, list[dict]]:
        try:
            try:
                result = await self._engine(self.backends.stt_finish(self.id))
            except UnknownStream:
                await self._restart_stream()
                result = await self._engine(self.backends.stt_finish(self.id))
        except (EngineUnavailable, UnknownStream) as exc:
            self._holds_slot = False  # the replica is gone or lost the stream; close() has nothing to free
            raise EngineUnavailable(str(exc)) from None
        self._holds_slot = False
        return result

    def _drop_turn(self) -> None:
        self.listening = False
        self.partial = ""
        self._turn_audio = []
        self._turn_samples = 0
        self._refused_at = None

    # ------------------------------------------------------------------ deadlines
    def next_deadline(self) -> float:
        """The monotonic time at which :meth:`check_deadlines` next has work: the open turn's
        ``max_turn_s`` or the idle limit. The receive loop waits for a frame until then."""
        idle_at = self._idle_deadline()
        turn_at = self._turn_deadline()
        return idle_at if turn_at is None else min(idle_at, turn_at)

    async def check_deadlines(self) -> bool:
        """End a spoken turn that has held its slot past ``max_turn_s`` (a client that stopped
        sending mid-turn); return True once nothing went either way for ``idle_timeout_s``."""
        turn_at = self._turn_deadline()
        if turn_at is not None and time.monotonic() >= turn_at:
            await self._end_long_turn()
        return time.monotonic() >= self._idle_deadline()

    def _idle_deadline(self) -> float:
        if self.reply is not None and not self.reply.task.done():
            # Waiting for a reply is not idleness (it may queue behind others' TTS): look again later.
            return time.monotonic() + self.cfg.idle_timeout_s
        return self._last_activity_at + self.cfg.idle_timeout_s

    def _turn_deadline(self) -> float | None:
        if self.listening and self._holds_slot:
            return self._slot_taken_at + self.cfg.max_turn_s
        return None

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
            async for delta in self._engine_stream(self.backends.llm_stream(list(self.history))):
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
        except EngineUnavailable as exc:  # a dead or stalled replica ends this reply, not the session
            log.warning("session %s turn %d: reply cut short: %s", self.id, turn, exc)
            speaker.cancel()
            await asyncio.gather(speaker, return_exceptions=True)
            await self.send_error(P.E_ENGINE_UNAVAILABLE, f"reply to turn {turn} cut short: an engine is unavailable ({exc})")
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
            codes = await self._engine(self.backends.tts_encode(pcm))
        except EngineUnavailable as exc:
            log.warning("session %s: encoding user audio: %s", self.id, exc)
            return
        except Exception:  # noqa: BLE001 - context is an improvement, never a failure
            log.exception("session %s: encoding user audio failed", self.id)
            return
        if len(codes):
            self._add_context(Segment(USER_SPEAKER, text, codes))

    async def _speak(self, reply: _Reply, clauses: asyncio.Queue, encoding: asyncio.Task | None,
                     ended_at: float, final_at: float, marks: dict) -> None:
        """Send the reply's audio, paced to ``pace_lead_s`` ahead of real time, while
        :meth:`_synthesize` makes it as fast as the TTS goes: the next clause's synthesis starts
        when the previous clause is made, not when it has been played, so a clause boundary is
        never dead air while the TTS runs faster than real time."""
        chunks: asyncio.Queue = asyncio.Queue()  # bounded by the reply: its clauses' frames
        synthesis = asyncio.create_task(self._synthesize(clauses, encoding, chunks))
        seq = 0
        last_at = None
        audio_s = 0.0
        try:
            while (item := await chunks.get()) is not None:
                clause, pcm, codes = item
                if clause is not None:  # the first chunk of a clause: it starts playing now
                    reply.spoken.append(clause)
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
            await synthesis  # raises what ended the synthesis early (e.g. EngineUnavailable)
        finally:
            synthesis.cancel()
            await asyncio.gather(synthesis, return_exceptions=True)

    async def _synthesize(self, clauses: asyncio.Queue, encoding: asyncio.Task | None,
                          chunks: asyncio.Queue) -> None:
        """Each clause through the TTS, in order, into ``chunks`` as (clause on its first chunk
        else None, pcm, codes); None at the end, also when it fails. A clause continues the voice
        of the reply's clauses made before it (their generated codes are its context)."""
        made_text: list[str] = []
        made_codes: list[np.ndarray] = []
        try:
            while (clause := await clauses.get()) is not None:
                if encoding is not None:
                    await encoding  # the user's turn joins the context before the first clause
                    encoding = None
                context = list(self.context)
                if made_codes:
                    context.append(Segment(0, " ".join(made_text), np.concatenate(made_codes)))
                first = True
                async for pcm, codes in self._engine_stream(self.backends.tts_stream(clause, context)):
                    chunks.put_nowait((clause if first else None, pcm, codes))
                    made_codes.append(codes)
                    first = False
                if not first:
                    made_text.append(clause)
        finally:
            chunks.put_nowait(None)
