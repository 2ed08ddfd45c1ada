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
import contextlib
import logging
import time
import uuid
from abc import abstractmethod
from dataclasses import dataclass, field
from typing import AsyncIterator, Awaitable, Callable, Protocol, TypeVar

import numpy as np

from pipeline import protocol as P
from pipeline.clauses import ClauseSplitter
from pipeline.listening import Listener
from pipeline.vad import SAMPLE_RATE as VAD_RATE, VADEvent, VADSettings
from pipeline.tts.prompt import Segment

log = logging.getLogger(__name__)

USER_SPEAKER = 1
TURN_DETECTION = ("vad", "manual")
BARGE_IN = ("vad", "words", "vad+words", "off")
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
    transcript and gives the slot back, ``stt_close`` gives it back without one (idempotent).

    The two implementations subclass this explicitly (``pipeline.services.LocalBackends``: the
    services in this process; ``deployments.gateway.RayBackends``: deployment handles), so a type
    checker verifies their signatures and a missing method fails at construction (abstract);
    tests/test_backends.py compares both with it. Test doubles may stay duck-typed."""

    # Any call may raise EngineUnavailable; stt_push and stt_finish raise UnknownStream.
    @abstractmethod
    async def stt_open(self, sid: str) -> None: ...  # raises NoFreeSlot; reopening an open sid restarts it
    @abstractmethod
    async def stt_push(self, sid: str, pcm: np.ndarray) -> list[dict]: ...  # [{"kind","text"}]
    @abstractmethod
    async def stt_finish(self, sid: str) -> tuple[str, list[dict]]: ...  # (text, words with times); frees the slot
    @abstractmethod
    async def stt_close(self, sid: str) -> None: ...
    @abstractmethod
    def llm_stream(self, messages: list[dict]) -> AsyncIterator[str]: ...
    # (int16 24 kHz chunk, Mimi codes [n, 32] of the frames that made it)
    @abstractmethod
    def tts_stream(self, text: str, context: list[Segment]) -> AsyncIterator[tuple[np.ndarray, np.ndarray]]: ...
    @abstractmethod
    async def tts_encode(self, pcm: np.ndarray) -> np.ndarray: ...  # int16 16 kHz -> codes [T, 32]


@dataclass
class SessionConfig:
    # Audio may lead real time by at most this much (None: send as fast as it is made).
    pace_lead_s: float | None = 0.3
    clause_max_words: int = 12
    # Turn detection (docs/protocol.md, "Turn taking"). "vad": hands-free: the VAD opens a spoken
    # turn at speech (with vad_preroll_ms before it), and a pause ends it once Smart Turn calls the
    # turn complete, or after eot_max_silence_ms of silence; turn.end works too. "manual": every
    # audio frame belongs to a turn, which ends on turn.end (or STT endpointing, or max_turn_s).
    turn_detection: str = "vad"
    vad_threshold: float = 0.5  # Silero speech probability of a 32 ms window that counts as speech
    vad_min_speech_ms: float = 64  # speech.started after this much speech
    vad_min_silence_ms: float = 200  # speech.stopped after this much silence; Smart Turn runs then
    vad_preroll_ms: float = 300  # a VAD-opened turn starts this long before the detected onset
    eot_threshold: float = 0.5  # Smart Turn probability at or above which a pause ends the turn
    eot_max_silence_ms: float = 1500  # a pause this long ends the turn whatever Smart Turn said
    vad_events: bool = True  # send speech.started / speech.stopped to the client
    # The bot's reply, as sent, is cancelled out of the microphone audio the VAD judges (echo.py).
    echo_cancellation: bool = True
    # Barge-in: user speech while a reply plays interrupts it. "vad": once the VAD has heard
    # barge_in_min_speech_ms of speech; "words": once the recogniser hears words (a non-empty
    # partial) in audio louder than barge_in_min_rms; "vad+words": whichever comes first; "off"
    # (or false). true means "vad". No interruption in the reply's first barge_in_grace_s.
    barge_in: bool | str = "vad"
    barge_in_min_speech_ms: float = 150
    barge_in_min_rms: float = 0.01  # of int16 full scale; quieter audio never interrupts by words
    barge_in_grace_s: float = 0.5  # no interruption during the reply's first audio
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
    # Per client address (pipeline/client_limits.py), checked before the WebSocket is accepted:
    # sessions it may hold at once (too_many_sessions, HTTP 429) and handshakes a minute
    # (too_many_handshakes, HTTP 429; ticket requests count too).
    max_sessions_per_client: int = 16
    handshakes_per_minute: int = 120
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
    on_turn_end: Callable[[str], None] | None = None  # what ended a turn (see Session._end_turn)
    on_smart_turn: Callable[[float], None] | None = None  # one Smart Turn call, seconds

    def __post_init__(self) -> None:
        for name in ("idle_timeout_s", "max_turn_s", "max_sessions", "engine_timeout_s",
                     "max_sessions_per_client", "handshakes_per_minute"):
            if not getattr(self, name) > 0:
                raise ValueError(f"SessionConfig.{name} must be > 0, got {getattr(self, name)!r}")
        if self.slot_retry_s < 0:
            raise ValueError(f"SessionConfig.slot_retry_s must be >= 0, got {self.slot_retry_s!r}")
        if self.turn_detection not in TURN_DETECTION:
            raise ValueError(f"SessionConfig.turn_detection must be one of {TURN_DETECTION}, got {self.turn_detection!r}")
        if self.barge_in_mode not in BARGE_IN:
            raise ValueError(f"SessionConfig.barge_in must be one of {BARGE_IN} or a bool, got {self.barge_in!r}")
        self.vad_settings  # validates the VAD's threshold and durations
        for name in ("vad_preroll_ms", "barge_in_min_speech_ms", "barge_in_grace_s", "barge_in_min_rms"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"SessionConfig.{name} must be >= 0, got {getattr(self, name)!r}")
        if not 0 <= self.eot_threshold <= 1:
            raise ValueError(f"SessionConfig.eot_threshold must be in [0, 1], got {self.eot_threshold!r}")
        if not self.eot_max_silence_ms >= self.vad_min_silence_ms:
            raise ValueError(f"SessionConfig.eot_max_silence_ms ({self.eot_max_silence_ms!r}) must be >= "
                             f"vad_min_silence_ms ({self.vad_min_silence_ms!r})")

    @property
    def barge_in_mode(self) -> str:
        if isinstance(self.barge_in, bool):
            return "vad" if self.barge_in else "off"
        return self.barge_in

    @property
    def vad_settings(self) -> VADSettings:
        return VADSettings(self.vad_threshold, self.vad_min_speech_ms, self.vad_min_silence_ms)

    @property
    def uses_vad(self) -> bool:
        return self.turn_detection == "vad" or "vad" in self.barge_in_mode or self.vad_events


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
        smart_turn=None,
    ):
        self.id = session_id or uuid.uuid4().hex
        self.cfg = cfg or SessionConfig()
        # Ears (echo cancellation + VAD) when any setting uses the VAD; Smart Turn for hands-free turns.
        self.ears = Listener(self.cfg.vad_settings, self.cfg.echo_cancellation) if self.cfg.uses_vad else None
        if smart_turn is None and self.cfg.turn_detection == "vad":
            from pipeline.smart_turn import shared_model

            smart_turn = shared_model()
        self.smart_turn = smart_turn
        self._eot_deadline: float | None = None  # a pause Smart Turn called incomplete ends the turn then
        self._ended_by_server = False  # hands-free: the last spoken turn was ended by the server, no speech since
        self.eot_probabilities: list[float] = []  # Smart Turn's last verdicts (at most 100), for tests and tools
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
            await self._on_microphone(msg.pcm)
        elif isinstance(msg, P.TextIn):
            await self._end_turn(typed_text=msg.text, by="typed")
        elif self._ended_by_server and not self.listening:
            # Hands-free, the server already ended the turn this turn.end ends (a push-to-talk
            # client's audio had a pause in it): nothing more to do, not an empty turn.
            self._ended_by_server = False
        else:
            await self._end_turn()

    async def _on_microphone(self, pcm: np.ndarray) -> None:
        """One audio frame: the ears hear it first (VAD events go out, speech over a reply barges
        in); then it goes to the open turn, or opens one (any audio in manual mode, speech with its
        pre-roll in vad mode); then a pause may end the turn."""
        if self.ears is None:
            await self._on_audio(pcm)
            return
        events = self.ears.hear(pcm)
        if self.cfg.vad_events:
            for ev in events:
                await self.send(P.speech_event(ev.kind, 1000 * ev.sample / VAD_RATE))
        if "vad" in self.cfg.barge_in_mode and self.ears.vad.speech_ms >= self.cfg.barge_in_min_speech_ms \
                and self._reply_interruptible():
            await self._interrupt(send_done=True)
        if self.cfg.turn_detection == "manual" or self.listening:
            await self._on_audio(pcm)
        else:
            onset = next((ev.sample for ev in events if ev.kind == "speech.started"), None)
            if onset is not None:
                preroll = int(self.cfg.vad_preroll_ms * VAD_RATE / 1000)
                await self._on_audio(self.ears.since(onset - preroll))
            elif self.ears.speaking:  # speech goes on after a turn ended mid-speech (turn.end, max_turn_s)
                await self._on_audio(pcm)
        if self.cfg.turn_detection == "vad" and self.listening:
            await self._end_turn_on_pause(events)

    async def _end_turn_on_pause(self, events: list[VADEvent]) -> None:
        """Hands-free end of turn: at speech.stopped, Smart Turn judges the turn's audio; complete
        ends the turn now, incomplete waits for speech again or eot_max_silence_ms of silence."""
        if self.ears.speaking:
            self._eot_deadline = None
            return
        if any(ev.kind == "speech.stopped" for ev in events):
            audio = np.concatenate(self._turn_audio) if self._turn_audio else np.zeros(0, np.int16)
            started = time.monotonic()
            p = await self.smart_turn.probability_async(audio)
            if self.cfg.on_smart_turn:
                self.cfg.on_smart_turn(time.monotonic() - started)
            self.eot_probabilities.append(p)
            del self.eot_probabilities[:-100]
            if p >= self.cfg.eot_threshold and not self.ears.speaking:
                await self._end_turn(by="smart_turn")
                return
            wait_s = (self.cfg.eot_max_silence_ms - self.ears.vad.silence_ms) / 1000
            self._eot_deadline = time.monotonic() + max(0.0, wait_s)
        if self._eot_deadline is not None and self.ears.vad.silence_ms >= self.cfg.eot_max_silence_ms:
            await self._end_turn(by="silence")

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
        self._ended_by_server = False
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
                await self._end_turn(by="endpoint")
                break

    def _should_barge_in(self) -> bool:
        """Barge-in by words: a non-empty partial from loud enough audio."""
        return "words" in self.cfg.barge_in_mode and self._turn_loud and self._reply_interruptible()

    def _reply_interruptible(self) -> bool:
        reply = self.reply
        if reply is None or reply.task.done():
            return False
        if reply.first_audio_at is None:
            return True  # nothing played yet: the user simply talks on
        return time.monotonic() - reply.first_audio_at >= self.cfg.barge_in_grace_s

    async def _end_long_turn(self) -> None:
        await self.send_error(P.E_TURN_TOO_LONG, f"a spoken turn lasts at most {self.cfg.max_turn_s:g} s; "
                              "it ends here as if turn.end had arrived")
        await self._end_turn(by="max_turn")

    async def _end_turn(self, typed_text: str | None = None, by: str = "turn_end") -> None:
        """End the current user turn (spoken or typed) and start its reply. ``by``: what ended it
        (turn_end, typed, smart_turn, silence, endpoint, max_turn), for the metrics."""
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
        self._ended_by_server = (self.cfg.turn_detection == "vad" and typed_text is None
                                 and by in ("smart_turn", "silence", "endpoint", "max_turn"))
        self.turn += 1
        turn = self.turn
        await self.send(P.transcript_final(text, turn, words))
        if self.cfg.on_turn:
            self.cfg.on_turn()
        if self.cfg.on_turn_end:
            self.cfg.on_turn_end(by if typed_text is None else "typed")
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
        self._eot_deadline = None
        self.partial = ""
        self._turn_audio = []
        self._turn_samples = 0
        self._refused_at = None

    # ------------------------------------------------------------------ deadlines
    def next_deadline(self) -> float:
        """The monotonic time at which :meth:`check_deadlines` next has work: the open turn's
        ``max_turn_s``, the end of a hands-free pause, or the idle limit. The receive loop waits
        for a frame until then."""
        return min(t for t in (self._idle_deadline(), self._turn_deadline(), self._eot_deadline) if t is not None)

    async def check_deadlines(self) -> bool:
        """End a spoken turn that has held its slot past ``max_turn_s`` (a client that stopped
        sending mid-turn); return True once nothing went either way for ``idle_timeout_s``."""
        if self._eot_deadline is not None and time.monotonic() >= self._eot_deadline:
            await self._end_turn(by="silence")  # a hands-free client went quiet after a pause: the turn is over
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
        # Once cancelled, the reply task sends nothing more (its next await raises), so the client
        # hears of the interruption at once, not after the engines have let go of its work.
        reply.task.cancel()
        if self.ears is not None:
            self.ears.stop_playback()  # the client drops what it has not played
        if send_done and not reply.done_sent:
            reply.done_sent = True
            await self.send(P.response_done(reply.turn, interrupted=True))
        try:
            await reply.task
        except asyncio.CancelledError:
            pass
        except Exception:  # noqa: BLE001 - the reply already reported its error
            pass
        self._remember_bot_turn(reply, " ".join(reply.spoken))
        if self.cfg.on_interrupt:
            self.cfg.on_interrupt()

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
            # aclosing: a cancelled reply closes the engine stream before the cancellation goes on (its
            # clean-up is queued on the inference thread by then), not whenever the collector finds it.
            async with contextlib.aclosing(self._engine_stream(self.backends.llm_stream(list(self.history)))) as deltas:
                async for delta in deltas:
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
                if self.ears is not None:
                    self.ears.played(pcm)
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
                async with contextlib.aclosing(self._engine_stream(self.backends.tts_stream(clause, context))) as made:
                    async for pcm, codes in made:  # (closed at once when cancelled, as the LLM stream above)
                        chunks.put_nowait((clause if first else None, pcm, codes))
                        made_codes.append(codes)
                        first = False
                if not first:
                    made_text.append(clause)
        finally:
            chunks.put_nowait(None)
