"""A phone call's media stream (Twilio Media Streams, Telnyx media streaming) onto one
conversation core.

The carrier opens the WebSocket and speaks first: ``start`` names the call, its audio format and
the parameters its setup passed, among them the stream's credential (a carrier's stream carries
no headers). :func:`serve_call` reads the stream up to its start, within ``start_within_s``, and
checks that credential (``verify``) before anything is held for the call: no session, no place
of the replica's (the gateway bounds such waiting streams apart, ``phone.unverified_streams``).
Only then is the call a :class:`PhoneSession`. The caller's
G.711 becomes ``Hear`` commands at the recogniser's rate; keys become ``Digits``. Reply audio goes
back as 20 ms G.711 frames, each reply chunk followed by a ``mark``: the carrier echoes it once the
caller's phone has played the audio before it, and the echo becomes ``Played``, so a reply cut by
a barge-in keeps in the history exactly what the caller heard. A cut reply's queued audio is
dropped at the carrier with ``clear``; a paused one (``resume_false_interruption``) too, and
what the caller had not heard of it is sent again first if it resumes (``unplayed.py``).
``stop`` (the call ended) closes the session.

Who answers is the call's agent (``pipeline/adapters/phone/config.py``): named by the start parameter
``agent`` (else the configured default), with ``instructions`` and ``voice`` parameters over it.
Its built-in call tools run here, between frames: ``end_call`` and ``transfer_call`` act through
the carrier's REST API (``pipeline/adapters/phone/call_control.py``) once the reply has played (its last mark
echoed); ``collect_digits`` takes keys as its result where the agent says ``dtmf: tool``.
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Awaitable, Callable

import numpy as np

from pipeline.wire import CloseConnection, WireSession
from pipeline.conversation.voice_offer import VoiceOffer
from pipeline.conversation.agent import DEFAULT_VOICE, BadSetting
from pipeline.audio_constants import REPLY_RATE
from pipeline.adapters.audio_formats import Decoder, Encoder
from pipeline.audio import pieces
from pipeline.conversation import commands as C
from pipeline.conversation import events as E
from pipeline.conversation.refusal import Refusal
from pipeline.conversation.observer import Observer
from pipeline.conversation.reply import CANCELLED
from pipeline.engines import Backends
from pipeline.door.admission import E_UNAUTHORIZED, Refused
from pipeline.adapters.phone.call_tools import CallTools
from pipeline.adapters.phone.call_control import CallControl
from pipeline.connection import Connection, SessionRegistry, serve_connection
from pipeline.errors import CLOSE_NORMAL, CLOSE_POLICY_VIOLATION, CLOSE_TRY_AGAIN_LATER
from pipeline.adapters.phone.config import PhoneConfig
from pipeline.session_config import SessionConfig
from pipeline.adapters.phone.unplayed import Held, Unplayed
from pipeline.adapters.phone.carriers import DIALECTS, FRAME_BYTES, CallStart, Dialect, StreamError, digit, mark_name, payload

log = logging.getLogger(__name__)

MAX_MESSAGE_CHARS = 64 * 1024  # a carrier's message: 20 ms of media is ~250 characters
MAX_MARKS = 4096  # marks awaiting their echo (a reply sends one per chunk; older ones are forgotten)
CREDENTIAL_PARAMETER = "ticket"  # the start parameter that carries the stream's credential
SILENCE = {"audio/pcmu": b"\xff", "audio/pcma": b"\xd5"}  # G.711's zero sample


@dataclass(frozen=True)
class SentMark:
    item_id: str
    audio_ms: float  # the reply's audio up to this mark
    chunk_ms: float  # the chunk it follows
    sent_at: float


def _monotonic() -> float:
    return time.monotonic()


def parse(frame: bytes | str) -> dict:
    """A carrier message: a JSON object with a string ``event``; raises StreamError."""
    if not isinstance(frame, str) or len(frame) > MAX_MESSAGE_CHARS:
        raise StreamError(f"a carrier message is a JSON text frame of at most {MAX_MESSAGE_CHARS} characters")
    try:
        msg = json.loads(frame)
    except (ValueError, RecursionError):
        raise StreamError("a carrier message is not JSON") from None
    if not isinstance(msg, dict) or not isinstance(msg.get("event"), str):
        raise StreamError("a carrier message is a JSON object with a string \"event\"")
    return msg


async def await_start(conn: Connection, dialect: Dialect) -> CallStart:
    """Read a carrier's stream up to its ``start`` (``connected`` comes first) and read that, every
    field by its type; raises StreamError at anything else first, or a malformed start."""
    while True:
        frame = await conn.receive()
        if frame is None:
            raise StreamError("the stream ended before its start")
        msg = parse(frame)
        if msg["event"] == "start":
            return dialect.start(msg)
        if msg["event"] != "connected":
            raise StreamError(f"{msg['event']!r} before start"[:100])


class StreamDoor:
    """What the gateway does once a carrier stream's start is verified (:func:`serve_call`): its
    waiting place becomes a session place (raises Refused when there is none)."""

    def verified(self) -> None:
        pass


async def serve_call(conn: Connection, backends: Backends, cfg: SessionConfig, registry: SessionRegistry,
                     provider: str, verify: Callable[[str | None], Awaitable[bool]] | None = None,
                     door: StreamDoor | None = None, start_within_s: float = 5.0,
                     observer: Observer | None = None, **session_args) -> None:
    """One carrier stream: its start read within ``start_within_s`` and its credential
    checked (``verify``) before anything is held for it; then, with a session place
    (``door.verified``), served as a :class:`PhoneSession` until it ends. A stream that fails
    any of this is closed 1008 with the reason (1013 when the server has no place)."""
    observer, door = observer or Observer(), door or StreamDoor()
    try:
        async with asyncio.timeout(start_within_s):
            call = await await_start(conn, DIALECTS[provider])
            if verify is not None and not await verify(call.parameters.get(CREDENTIAL_PARAMETER)):
                observer.error(E_UNAUTHORIZED)
                raise StreamError("unauthorized")
        door.verified()
    except (StreamError, TimeoutError, Refused) as exc:
        if isinstance(exc, StreamError) and exc.reason != "unauthorized":
            observer.error("bad_stream")
        reason = exc.reason if isinstance(exc, StreamError) else \
            f"no start within {start_within_s:g} s" if isinstance(exc, TimeoutError) else exc.code
        log.warning("call stream refused: %s", reason)
        code = CLOSE_TRY_AGAIN_LATER if isinstance(exc, Refused) and exc.status == 503 else CLOSE_POLICY_VIOLATION
        try:
            await conn.close(code, reason.encode()[:120].decode(errors="ignore"))  # a reason is at most 123 bytes
        except Exception:  # noqa: BLE001 - the carrier has gone already
            pass
        return
    await serve_connection(conn, backends, cfg, registry, PhoneSession, observer=observer, provider=provider,
                           call=call, **session_args)


class PhoneSession(WireSession):
    """A call whose start was read and verified (:func:`serve_call`): ``call``."""

    def __init__(self, send: Callable[[str], Awaitable[None]], backends: Backends, cfg: SessionConfig | None = None,
                 session_id: str | None = None, smart_turn=None, voices: tuple[str, ...] = (DEFAULT_VOICE,),
                 observer: Observer | None = None, provider: str = "twilio", call: CallStart | None = None,
                 phone: PhoneConfig | None = None, calls: CallControl | None = None,
                 offer: VoiceOffer | None = None):
        super().__init__(send, observer)
        if call is None:
            raise ValueError("a PhoneSession serves a started call: serve_call reads its start first")
        self.dialect = DIALECTS[provider]
        self.core = self.conversation(backends, cfg, session_id, smart_turn, voices, _monotonic, offer=offer)
        self.phone = phone or PhoneConfig()
        self.tools = CallTools(self.core.do, self.phone, calls, self.deadline_changed.set, self.observer)
        self.call = call
        self._decoder = Decoder(call.audio)
        self._encoders: dict[str, Encoder] = {}  # reply id -> its encoder
        self._unsent = b""  # encoded audio short of a whole frame
        self._marks: OrderedDict[str, SentMark] = OrderedDict()  # marks awaiting their echo
        self._last_echo: tuple[str, float] | None = None  # (item id, when) of the last echoed mark
        self._unplayed = Unplayed()  # the reply's chunks the caller's phone has not played
        self._held: Held | None = None  # a paused reply's, cleared at the carrier, sent again on resume
        self._heard: C.Played | None = None  # where a paused reply stopped, told with the next media
        self._resent = 0
        self._sending = asyncio.Lock()  # reply audio, its pause, resume and end go to the carrier in turn

    async def start(self) -> None:
        try:
            await self._answer_as(self.call.parameters)
        except StreamError as exc:
            self.observer.error("bad_stream")
            raise CloseConnection(None, exc.reason, CLOSE_POLICY_VIOLATION, exc.reason.encode()[:120].decode(
                errors="ignore")) from None
        log.info("call %s (%s) streams as session %s", self.call.call_id, self.dialect.name, self.id)

    @staticmethod
    def error_frame(code: str, message: str) -> str:
        return json.dumps({"event": "error", "code": code, "message": message})  # carriers ignore it; logs show it

    def next_deadline(self) -> float:
        due = self.tools.next_deadline(_monotonic())
        return self.core.next_deadline() if due is None else due

    async def check_deadlines(self) -> float | None:
        await self.tools.run_asked()
        return await self.core.check_deadlines()

    # ------------------------------------------------------------------ carrier messages in
    async def on_frame(self, frame: bytes | str) -> None:
        self.core.touch()
        try:
            msg = parse(frame)
            event = msg["event"]
            if event == "connected":
                return
            if event == "start":
                raise StreamError("a second start")
            if event == "media":
                await self._media(msg)
            elif event == "dtmf":
                await self.tools.key(digit(msg))
            elif event == "mark":
                await self._echoed(mark_name(msg))
            elif event == "stop":
                raise CloseConnection(None, "the call ended", CLOSE_NORMAL, "call ended")
        except StreamError as exc:
            self.observer.error("bad_stream")
            log.warning("call stream %s refused: %s", self.id, exc.reason)
            reason = exc.reason.encode()[:120].decode(errors="ignore")  # a close reason is at most 123 bytes
            raise CloseConnection(None, exc.reason, CLOSE_POLICY_VIOLATION, reason) from None
        except (BadSetting, Refusal) as exc:  # the conversation's limits: the call goes on
            log.warning("call stream %s: %s", self.id, exc)

    async def _answer_as(self, parameters: dict[str, str]) -> None:
        """The call's agent: the one its ``agent`` parameter names (else the default), its
        ``instructions``, ``voice`` and ``language`` parameters over it."""
        name = parameters.get("agent")
        try:
            agent = self.tools.agent = self.phone.agent(name)
        except KeyError:
            raise StreamError(f"the call names agent {name!r}, which this server does not have") from None
        changes = agent.agent_changes()
        changes.update({k: parameters[k] for k in ("instructions", "voice", "language") if k in parameters})
        try:
            await self.core.do(C.Configure(turn_taking=agent.turn_taking_changes(), agent=changes,
                                           greet=agent.speaks_first))
        except BadSetting as exc:
            raise StreamError(f"the call's {exc.param}: {exc.message}") from None

    async def _media(self, msg: dict) -> None:
        pcm = self._decoder.decode(payload(msg))
        if self._heard is not None:
            heard, self._heard = self._heard, None
            await self.core.do(heard)
        for piece in pieces(pcm):
            await self.core.do(C.Hear(piece))

    async def _echoed(self, name: str) -> None:
        """The audio before mark ``name`` has played on the caller's phone: how long it waited at
        the carrier, and the dead air the caller heard before its chunk, go to the metrics."""
        sent = self._marks.pop(name, None)
        if sent is None:
            return
        now = _monotonic()
        self._unplayed.echoed(name, now)
        self.observer.phone_playback(self.dialect.name, now - sent.sent_at)
        if self._last_echo is not None and self._last_echo[0] == sent.item_id:
            self.observer.phone_gap(self.dialect.name, max(0.0, now - self._last_echo[1] - sent.chunk_ms / 1000))
        self._last_echo = (sent.item_id, now)
        await self.core.do(C.Played(sent.item_id, sent.audio_ms, playing=bool(self._marks)))

    # ------------------------------------------------------------------ conversation events out
    async def emit(self, ev: E.Event) -> None:
        if isinstance(ev, (E.ReplyAudio, E.ReplyDone, E.ReplyPaused, E.ReplyResumed)):
            async with self._sending:  # one at a time: a pause (a frame's) never lands inside a chunk's frames
                await self._reply_event(ev)
        if isinstance(ev, E.ToolCallAsked):
            self.tools.ask(ev.call)
        elif isinstance(ev, E.CallOver):  # the agent ended the call and its last words have played
            what = await self.tools.finish(self.call.call_id, ev.transfer_to)
            raise CloseConnection(None, f"the call was {what}", CLOSE_NORMAL, f"call {what}"[:120])
        elif isinstance(ev, E.Error):
            log.info("call stream %s: %s: %s", self.id, ev.code, ev.message)  # a phone has no channel for it

    async def _reply_event(self, ev) -> None:
        if isinstance(ev, E.ReplyAudio):
            await self._audio(ev)
        elif isinstance(ev, E.ReplyDone):
            await self._reply_done(ev)
        elif isinstance(ev, E.ReplyPaused):
            await self._pause(ev.reply)
        else:
            await self._resume(ev.reply)

    async def _send(self, msg: dict) -> None:
        await self.send_frame(json.dumps(msg))

    async def _audio(self, ev: E.ReplyAudio) -> None:
        await self._chunk(ev.reply, ev.pcm, 1000 * ev.reply.samples / REPLY_RATE, f"{ev.reply.id}.{ev.seq}")

    async def _chunk(self, reply, pcm: np.ndarray, start_ms: float, name: str) -> None:
        """Reply audio (``start_ms`` into its item) to the carrier, then mark ``name``."""
        encoder = self._encoders.setdefault(reply.id, Encoder(self.call.audio))
        await self._frames(self._unsent + encoder.encode(pcm))
        unsent_ms = len(self._unsent) / (self.call.audio.rate / 1000)  # the part of a frame still here
        now = _monotonic()
        self._marks[name] = SentMark(reply.item_id, start_ms + 1000 * len(pcm) / REPLY_RATE - unsent_ms,
                                     1000 * len(pcm) / REPLY_RATE, now)
        while len(self._marks) > MAX_MARKS:
            self._marks.popitem(last=False)
        self._unplayed.sent(name, reply.item_id, start_ms, pcm, now)
        await self._send(self.dialect.mark(self.call.stream_id, name))

    async def _pause(self, reply) -> None:
        """Speech paused the reply: the carrier drops what it holds (it cannot pause), and what the
        caller had not heard is kept to send first when the reply resumes."""
        self._held = self._unplayed.hold(reply.item_id, _monotonic())
        self._drop(reply)
        self._encoders[reply.id] = Encoder(self.call.audio)
        await self._send(self.dialect.clear(self.call.stream_id))
        if self._held is not None:  # told with the next media: what the caller heard of it
            self._heard = C.Played(self._held.item_id, self._held.audio_ms, playing=False)

    async def _resume(self, reply) -> None:
        held, self._held = self._held, None
        if held is not None and held.item_id == reply.item_id and len(held.pcm):
            self._resent += 1
            await self._chunk(reply, held.pcm, held.audio_ms, f"{reply.id}.again{self._resent}")

    def _drop(self, reply) -> None:
        """What the carrier holds of ``reply`` is dropped: its late marks mean nothing."""
        self._unsent = b""
        for name in [n for n, m in self._marks.items() if m.item_id == reply.item_id]:
            del self._marks[name]
        self._last_echo = None

    async def _frames(self, data: bytes) -> None:
        whole = len(data) - len(data) % FRAME_BYTES
        for at in range(0, whole, FRAME_BYTES):
            await self._send(self.dialect.media(self.call.stream_id, data[at:at + FRAME_BYTES]))
        self._unsent = data[whole:]

    async def _reply_done(self, ev: E.ReplyDone) -> None:
        encoder = self._encoders.pop(ev.reply.id, None)
        self._held = self._heard = None
        if ev.reply.status == CANCELLED:  # what it queued is dropped
            self._unplayed.forget()
            self._drop(ev.reply)
            await self._send(self.dialect.clear(self.call.stream_id))
        elif encoder is not None:  # the last samples, padded to a whole frame of silence
            tail = self._unsent + encoder.encode(np.zeros(0, np.int16), last=True)
            if tail:
                pad = SILENCE[self.call.audio.type] * (-len(tail) % FRAME_BYTES)
                await self._frames(tail + pad)
