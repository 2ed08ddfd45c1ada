"""Protocol v1 (docs/protocol.md): binary msgpack frames onto one conversation core.

:class:`Session` parses each client frame (``pipeline.adapters.v1.protocol``) into a command for its
:class:`~pipeline.conversation.core.Conversation`, and turns each event of the core into v1's
message. It holds no conversation rule; bad input costs one ``error`` message.
"""
from __future__ import annotations

import time
from typing import Awaitable, Callable

import numpy as np

from pipeline.adapters.v1 import protocol as P
from pipeline.wire import WireSession
from pipeline.conversation.voice_offer import VoiceOffer
from pipeline.conversation.agent import DEFAULT_VOICE, MAX_VOICE_CLIP_S, BadSetting
from pipeline.audio_constants import REPLY_RATE
from pipeline.conversation.calls import ToolResultError
from pipeline.conversation import commands as C
from pipeline.conversation import events as E
from pipeline.conversation.refusal import Refusal
from pipeline.conversation.observer import Observer
from pipeline.engines import Backends
from pipeline.session_config import SessionConfig

V1_NAMES = {field: name for name, field in P.SETTINGS.items()} | {"voice_clip": "voice.clip"}  # field -> v1 name


def _monotonic() -> float:
    return time.monotonic()  # looked up at each call: tests replace this module's ``time``


class Session(WireSession):
    resumable = True  # a dropped connection may resume (pipeline/resume/keeper.py)

    def __init__(self, send: Callable[[bytes], Awaitable[None]], backends: Backends, cfg: SessionConfig | None = None,
                 session_id: str | None = None, smart_turn=None, voices: tuple[str, ...] = (DEFAULT_VOICE,),
                 observer: Observer | None = None, offer: VoiceOffer | None = None):
        super().__init__(send, observer)
        self.core = self.conversation(backends, cfg, session_id, smart_turn, voices, _monotonic, offer=offer)
        self.voices = tuple(voices)  # what session.ready offers
        self.offer = offer or VoiceOffer()  # ... and the languages a session may choose
        self._clip: list[np.ndarray] = []  # voice.clip pieces so far
        self._clip_samples = 0

    async def start(self) -> None:
        """Greet the client. Nothing is taken from the engines until a spoken turn starts."""
        await self.send(P.session_ready(self.id, self.resume_fields, self.voices, self.offer.describe()))

    async def going_away(self, resume_token: str | None, reason: str) -> None:
        """The reply being sent ends here (response.done, interrupted); the client is told where to go on."""
        await self.core.stop_replying()
        await self.send(P.going_away(resume_token, reason))

    async def send(self, msg: dict) -> None:
        await self.send_frame(P.pack(msg), is_error=msg.get("type") == "error")

    @staticmethod
    def error_frame(code: str, message: str) -> bytes:
        return P.pack(P.error(code, message))

    # ------------------------------------------------------------------ frames in
    async def on_frame(self, frame: bytes | str) -> None:
        """One client frame -> one command. Bad input costs one ``error`` message, nothing more."""
        self.core.touch()
        try:
            msg = P.parse_client_frame(frame)
        except P.ProtocolError as exc:
            await self.send_error(exc.code, exc.message)
            return
        try:
            command = self._command(msg)
            if command is not None:
                done = await self.core.do(command)
                if isinstance(command, C.Configure):
                    await self.send(P.session_updated({V1_NAMES.get(k, k): v for k, v in done.describe().items()}))
        except BadSetting as exc:
            self.observer.error(P.E_BAD_SETTING)
            await self.send(P.error(P.E_BAD_SETTING, exc.message, V1_NAMES.get(exc.param, exc.param)))
        except Refusal as exc:
            await self.send_error(exc.code, exc.message)
        except ToolResultError as exc:  # a result for a call not waited on is ignored; one too large is told
            if exc.code == P.E_TOOL_RESULT_TOO_LARGE:
                await self.send_error(exc.code, exc.message)

    def _command(self, msg) -> C.Command | None:
        if isinstance(msg, P.AudioIn):
            return C.Hear(msg.pcm)
        if isinstance(msg, P.TextIn):
            return C.UserText(msg.text, overrides=msg.response or {})
        if isinstance(msg, P.TurnEnd):
            return C.EndTurn(overrides=msg.response or {})
        if isinstance(msg, P.SessionUpdate):
            return C.Configure(agent=msg.settings)
        if isinstance(msg, P.ToolResult):
            return C.ToolResult(msg.call_id, msg.output, then="respond" if msg.respond else "close")
        if isinstance(msg, P.VoiceClip):
            return self._voice_clip(msg)
        return None

    def _voice_clip(self, msg: P.VoiceClip) -> C.Configure | None:
        """Pieces of the session's own reference clip, buffered (at most MAX_VOICE_CLIP_S); the last
        (done) one is the command."""
        self._clip.append(msg.pcm)
        self._clip_samples += len(msg.pcm)
        if self._clip_samples > MAX_VOICE_CLIP_S * REPLY_RATE:
            self._clip, self._clip_samples = [], 0
            raise BadSetting("voice_clip", f"a voice clip lasts at most {MAX_VOICE_CLIP_S:g} s; it is dropped")
        if not msg.done:
            return None
        pcm, self._clip, self._clip_samples = np.concatenate(self._clip), [], 0
        return C.Configure(voice_clip=C.VoiceClip(pcm, msg.text))

    # ------------------------------------------------------------------ events out
    async def emit(self, event: E.Event) -> None:
        msg = _message(event)
        if msg is not None:
            await self.send(msg)


def _message(ev: E.Event) -> dict | None:
    """The v1 message of one core event (None: v1 has none for it)."""
    if isinstance(ev, (E.SpeechStarted, E.SpeechStopped)):
        return P.speech_event("speech.started" if isinstance(ev, E.SpeechStarted) else "speech.stopped", ev.audio_ms)
    if isinstance(ev, E.TranscriptDelta):
        return P.transcript_partial(ev.text, ev.turn)
    if isinstance(ev, E.TurnEnded):
        return P.transcript_final(ev.text, ev.turn, ev.words)
    if isinstance(ev, E.ReplyText):
        return P.response_text(ev.delta, ev.reply.turn)
    if isinstance(ev, E.ReplyAudio):
        return P.audio_out(ev.pcm, ev.reply.turn, ev.seq)
    if isinstance(ev, E.ReplyPaused):
        return P.response_paused(ev.reply.turn)
    if isinstance(ev, E.ReplyResumed):
        return P.response_resumed(ev.reply.turn)
    if isinstance(ev, E.TurnDone):
        return P.response_done(ev.turn, ev.interrupted, ev.timings)
    if isinstance(ev, E.ToolCallAsked):
        return P.tool_call(ev.call.call_id, ev.call.name, ev.call.arguments, ev.reply.turn)
    if isinstance(ev, E.ToolCancelled):
        return P.tool_cancelled(ev.call.call_id, ev.turn, ev.reason)
    if isinstance(ev, E.Error):
        return P.error(ev.code, ev.message)
    return None  # ReplyStarted, ReplyDone: the reply's text and audio carry the turn's number
