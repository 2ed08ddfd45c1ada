"""The OpenAI Realtime protocol (GA events, JSON text frames) onto one conversation core.

:class:`RealtimeSession` reads each client event (``pipeline/adapters/realtime/client_events.py``) into a
command for its :class:`~pipeline.conversation.core.Conversation`, and writes each event of the
core as the server events that say it (``pipeline/adapters/realtime/events.py``). It keeps what only this
wire has: the session object a client reads back, the audio formats, and each reply's encoder.
docs/realtime.md lists every event, and where this server differs from OpenAI's. Every client
event that cannot be served gets one ``error`` event naming its ``event_id``.
"""
from __future__ import annotations

import base64
import json
import time
from dataclasses import dataclass
from typing import Any, Awaitable, Callable

import numpy as np

from pipeline.wire import WireSession
from pipeline.conversation.voice_offer import VoiceOffer
from pipeline.conversation.agent import DEFAULT_VOICE, AgentSettings, BadSetting
from pipeline.audio_constants import CODEC_FRAME_S, USER_RATE
from pipeline.adapters.audio_formats import Decoder, Encoder
from pipeline.audio import pieces
from pipeline.conversation.calls import ToolResultError
from pipeline.conversation import commands as C
from pipeline.conversation import events as CE
from pipeline.conversation.refusal import Refusal
from pipeline.conversation.observer import Observer
from pipeline.conversation.reply import COMPLETED
from pipeline.engines import Backends, EngineUnavailable
from pipeline.errors import CLIENT_CAUSED, E_ENGINE_UNAVAILABLE, E_NO_OPEN_TURN, E_TOOL_RESULT_TOO_LARGE
from pipeline.conversation.history import new_id
from pipeline.adapters.realtime import client_events as R
from pipeline.adapters.realtime import events as E
from pipeline.adapters.realtime import session_object
from pipeline.adapters.realtime.client_events import ClientEventError
from pipeline.session_config import SessionConfig

# AgentSettings fields -> where they live in the Realtime session object (for errors' ``param``)
AGENT_PARAMS = {"instructions": "session.instructions", "voice": "session.audio.output.voice",
                "modalities": "session.output_modalities", "max_output_tokens": "session.max_output_tokens",
                "temperature": "session.temperature", "tools": "session.tools", "tool_choice": "session.tool_choice",
                "voice_clip": "session.audio.output.voice_clip",
                "language": "session.audio.input.transcription.language"}


def _monotonic() -> float:
    return time.monotonic()


def refusal(exc: ClientEventError | Refusal | BadSetting) -> tuple[str, str, str | None]:
    """(code, message, param) of an ``error`` event for what the client sent."""
    if isinstance(exc, BadSetting):
        param = exc.param if exc.param.startswith(("session", "response")) else f"session.{exc.param}"
        return "invalid_value", exc.message, AGENT_PARAMS.get(exc.param, param)
    return exc.code, exc.message, AGENT_PARAMS.get(exc.param, exc.param)


def check_opening_session(session: Any, server: SessionConfig, voices: tuple[str, ...],
                          offer: VoiceOffer | None = None) -> dict:
    """The session object a call is made with (a WebRTC offer's ``session`` part, a client
    secret's), checked as ``session.update`` checks it, before anything exists for the call;
    returns its known part. Raises BadSetting or ClientEventError (:func:`refusal` words them)."""
    _, terms, clip = session_object.read(session, session_object.initial("sess", "gapless", server), server)
    offer = offer or VoiceOffer()
    agent = AgentSettings().updated(terms.agent, voices, offer)
    if clip is not None and not offer.takes_clip(agent.voice):
        raise BadSetting("voice_clip", f"voice {agent.voice!r} takes no voice clip (it is a speaker embedding)")
    if clip is not None:
        R.voice_clip(clip)
    return session_object.known(session)


@dataclass
class _ReplyWire:
    """What the wire keeps of one reply: its encoder and what its response object says."""

    encoder: Encoder
    speaks: bool
    voice: str
    metadata: dict | None
    output_format: dict
    max_output_tokens: Any


class RealtimeSession(WireSession):
    def __init__(self, send: Callable[[str], Awaitable[None]], backends: Backends, cfg: SessionConfig | None = None,
                 session_id: str | None = None, smart_turn=None, voices: tuple[str, ...] = (DEFAULT_VOICE,),
                 model: str = "gapless", beta: bool = False, observer: Observer | None = None, **core_options):
        super().__init__(send, observer)
        self.server_cfg = cfg or SessionConfig()
        # A WebSocket client plays out what it holds when a reply pauses (no event tells it to stop);
        # a WebRTC call's track, which the server holds, pauses.
        core_options.setdefault("client_pauses", core_options.get("holds_playback", False))
        self.core = self.conversation(backends, self.server_cfg, session_id or new_id("sess"), smart_turn, voices,
                                      _monotonic, **core_options)
        self.beta = beta
        self.session = session_object.initial(self.id, model, self.server_cfg)
        self.terms = session_object.apply(self.session, self.server_cfg)
        self._voice_clip: dict | None = None  # what session.updated says of the session's own clip
        self._decoder = Decoder(self.terms.input_format)
        self._replies: dict[str, _ReplyWire] = {}
        self._client_event_id: str | None = None  # the event being handled (errors name it)

    async def start(self) -> None:
        await self.core.do(C.Configure(self.terms.turn_taking, self.terms.agent, self.terms.reply_on_turn_end))
        await self.send({"type": "session.created", "session": self.describe()})

    @staticmethod
    def error_frame(code: str, message: str) -> str:
        return json.dumps({"event_id": new_id("event"), **E.error(E.SERVER_ERROR, code, message)})

    async def send(self, event: dict) -> None:
        event = {"event_id": new_id("event"), **(E.beta(event) if self.beta else event)}
        await self.send_frame(json.dumps(event), is_error=event["type"] == "error")

    def describe(self) -> dict:
        return session_object.describe(self.session, self._voice_clip, self.beta)

    # ------------------------------------------------------------------ client events in
    async def on_frame(self, frame: bytes | str) -> None:
        """One client event. Anything wrong with it costs one ``error`` event, nothing more."""
        self.core.touch()
        self._client_event_id = None
        try:
            event = R.parse(frame)
            self._client_event_id = R.event_id(event)
            R.check_size(event, frame)
            handler = self.HANDLERS.get(event["type"])
            if handler is None:
                raise ClientEventError("unknown_event", f"unknown or unsupported client event type {event['type']!r}")
            await handler(self, event)
        except (ClientEventError, Refusal, BadSetting) as exc:
            await self._refuse(*refusal(exc))
        except ToolResultError as exc:
            await self._refuse(exc.code, exc.message,
                               "item.output" if exc.code == E_TOOL_RESULT_TOO_LARGE else "item.call_id")
        except EngineUnavailable as exc:  # an audio item the recogniser could not hear
            await self._refuse(E_ENGINE_UNAVAILABLE, f"the recogniser could not hear this item ({exc})")
        finally:
            self._client_event_id = None

    async def _refuse(self, code: str, message: str, param: str | None = None) -> None:
        self.observer.error(code)
        await self.send(E.error(E.INVALID_REQUEST, code, message, param, self._client_event_id))

    async def _session_update(self, event: dict) -> None:
        await self._configure(R.field_object(event, "session"))
        await self.send({"type": "session.updated", "session": self.describe()})

    async def _configure(self, update: dict) -> None:
        """Apply a session object's changes, every one checked first (raises, changing nothing)."""
        merged, terms, clip = session_object.read(update, self.session, self.server_cfg, self.beta)
        agent = await self.core.do(C.Configure(terms.turn_taking, terms.agent, terms.reply_on_turn_end,
                                               R.voice_clip(clip) if clip is not None else None))
        self.session, self.terms = merged, terms
        reference = agent.voice_reference
        self._voice_clip = None if reference is None else {"transcript": reference.text,
                                                           "seconds": round(len(reference.codes) * CODEC_FRAME_S, 2)}
        if self._decoder.format != terms.input_format:
            self._decoder = Decoder(terms.input_format)

    async def _append(self, event: dict) -> None:
        await self._hear(R.appended_audio(event, self._decoder))

    async def _hear(self, pcm: np.ndarray) -> None:
        for piece in pieces(pcm):
            await self.core.do(C.Hear(piece))

    async def _commit(self, event: dict) -> None:
        await self._hear(self._decoder.flush())
        try:  # a commit answers where the server detects turns and was told to (create_response): respond=None
            await self.core.do(C.EndTurn(respond=None, must_be_open=True))
        except Refusal as refused:
            if refused.code != E_NO_OPEN_TURN:
                raise
            raise ClientEventError("input_audio_buffer_commit_empty",
                                   "nothing to commit: no audio since the last turn (a VAD may have ended it already)"
                                   ) from None

    async def _clear(self, event: dict) -> None:
        await self.core.do(C.ClearAudio())
        self._decoder = Decoder(self.terms.input_format)
        await self.send({"type": "input_audio_buffer.cleared"})

    async def _item_create(self, event: dict) -> None:
        command, after = R.item_command(event, self.terms.input_format), event.get("previous_item_id")
        added = await self.core.do(command)
        if isinstance(command, C.AddUserAudio):
            await self._send_all(E.user_turn(added.item, after, self.terms.transcription, len(command.pcm) / USER_RATE))
        else:  # an item, or a call's output
            await self._send_all(E.items_added(E.item(added.item), added.previous_id))

    async def _item_retrieve(self, event: dict) -> None:
        found, live = await self.core.do(C.GetItem(event.get("item_id")))
        await self.send({"type": "conversation.item.retrieved",
                         "item": E.reply_item(found.id, found.audio, found.text, "in_progress") if live else E.item(found)})

    async def _item_delete(self, event: dict) -> None:
        await self.core.do(C.DeleteItem(event.get("item_id")))
        await self.send({"type": "conversation.item.deleted", "item_id": event["item_id"]})

    async def _item_truncate(self, event: dict) -> None:
        item_id, end = event.get("item_id"), event.get("audio_end_ms")
        await self.core.do(C.Truncate(item_id, end))
        await self.send({"type": "conversation.item.truncated", "item_id": item_id,
                         "content_index": event.get("content_index", 0), "audio_end_ms": end})

    async def _response_create(self, event: dict) -> None:
        params = event.get("response") or {}
        if not isinstance(params, dict):
            raise ClientEventError("invalid_value", "response must be an object", "response")
        await self.core.do(C.Respond(session_object.response_overrides(params), metadata=params.get("metadata")))

    async def _response_cancel(self, event: dict) -> None:
        await self.core.do(C.CancelReply(event.get("response_id")))

    HANDLERS = {
        "session.update": _session_update,
        "input_audio_buffer.append": _append,
        "input_audio_buffer.commit": _commit,
        "input_audio_buffer.clear": _clear,
        "conversation.item.create": _item_create,
        "conversation.item.retrieve": _item_retrieve,
        "conversation.item.delete": _item_delete,
        "conversation.item.truncate": _item_truncate,
        "response.create": _response_create,
        "response.cancel": _response_cancel,
    }

    # ------------------------------------------------------------------ core events out
    async def _send_all(self, events: list[dict]) -> None:
        for event in events:
            await self.send(event)

    async def emit(self, ev: CE.Event) -> None:
        if isinstance(ev, (CE.SpeechStarted, CE.SpeechStopped)):
            started = isinstance(ev, CE.SpeechStarted)
            await self.send({"type": f"input_audio_buffer.speech_{'started' if started else 'stopped'}",
                             "audio_start_ms" if started else "audio_end_ms": int(ev.audio_ms), "item_id": ev.item_id})
        elif isinstance(ev, CE.TurnEnded):
            await self.send({"type": "input_audio_buffer.committed", "item_id": ev.item.id,
                             "previous_item_id": ev.previous_id})
            await self._send_all(E.user_turn(ev.item, ev.previous_id, self.terms.transcription, ev.audio_s))
        elif isinstance(ev, CE.ReplyStarted):
            await self._reply_started(ev)
        elif isinstance(ev, CE.ReplyText):
            speaks = self._replies[ev.reply.id].speaks
            await self.send({"type": "response.output_audio_transcript.delta" if speaks else "response.output_text.delta",
                             **E.at(ev.reply.id, ev.reply.item_id), "delta": ev.delta})
        elif isinstance(ev, CE.ReplyAudio):
            data = self._replies[ev.reply.id].encoder.encode(ev.pcm)
            await self.send({"type": "response.output_audio.delta", **E.at(ev.reply.id, ev.reply.item_id),
                             "delta": base64.b64encode(data).decode("ascii")})
        elif isinstance(ev, CE.ReplyDone):
            await self._reply_done(ev)
        elif isinstance(ev, CE.ToolCallAsked):
            await self._send_all(E.function_call(ev.reply.id, len(ev.reply.calls), ev.item, ev.previous_id))
        elif isinstance(ev, CE.Error):
            kind = E.INVALID_REQUEST if ev.code in CLIENT_CAUSED else E.SERVER_ERROR
            await self.send(E.error(kind, ev.code, ev.message, None, self._client_event_id))
        # TranscriptDelta (transcription follows the commit, as OpenAI's), ReplyPaused / ReplyResumed
        # (the client plays out what it has, then waits), TurnDone, ToolCancelled (a late output gets
        # call_cancelled): this protocol has no event for them

    def _response(self, reply, wire: _ReplyWire, status: str, output: list[dict], details=None, usage=None) -> dict:
        return E.response(reply.id, status, output, list(reply.settings.modalities), wire.voice, wire.output_format,
                          wire.max_output_tokens, wire.metadata, details, usage)

    async def _reply_started(self, ev: CE.ReplyStarted) -> None:
        reply = ev.reply
        wire = self._replies[reply.id] = _ReplyWire(
            Encoder(self.terms.output_format), reply.settings.speaks, reply.settings.voice, reply.metadata,
            self.terms.output_format.describe(), reply.settings.max_output_tokens or "inf")
        await self.send({"type": "response.created", "response": self._response(reply, wire, "in_progress", [])})
        if reply.messages is not None:
            await self._send_all(E.reply_opened(reply.id, reply.item_id, wire.speaks, ev.previous_id))

    async def _reply_done(self, ev: CE.ReplyDone) -> None:
        reply, wire = ev.reply, self._replies.pop(ev.reply.id)
        output: list[dict] = []
        if reply.messages is not None:
            tail = wire.encoder.encode(np.zeros(0, np.int16), last=True) if wire.speaks else b""
            events, closed = E.reply_closed(reply.id, reply.item_id, wire.speaks, ev.transcript,
                                            "completed" if reply.status == COMPLETED else "incomplete",
                                            base64.b64encode(tail).decode("ascii") if tail else None)
            await self._send_all(events)
            output = [closed, *(E.item(it) for it in ev.calls)]
        usage = E.usage(*reply.usage) if reply.usage else None
        await self.send({"type": "response.done", "response": self._response(
            reply, wire, reply.status, output, E.status_details(reply.status, reply.reason), usage)})
