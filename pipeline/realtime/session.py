"""The OpenAI Realtime protocol (GA events, JSON text frames) onto one conversation core.

A :class:`RealtimeSession` is the Realtime twin of protocol v1's ``pipeline.session.Session``:
it parses client events, calls the same :class:`~pipeline.conversation.Conversation`, and
turns what the core reports into server events. Everything a conversation does (turn taking,
barge-in, pacing, slots, engine failures) is the core's; this module maps names and shapes,
converts audio formats, and keeps the session object a client reads back. docs/realtime.md
lists every event, and where this server differs from OpenAI's.

Every client event that cannot be served gets one ``error`` event naming its ``event_id``; the
session goes on unchanged.
"""
from __future__ import annotations

import asyncio
import base64
import binascii
import copy
import json
import logging
import time
from dataclasses import dataclass
from typing import Any, Awaitable, Callable

import numpy as np

from pipeline.agent import DEFAULT_VOICE, MAX_VOICE_CLIP_S, MAX_VOICE_CLIP_TEXT, BadSetting
from pipeline.audio_formats import ENGINE_INPUT_RATE, Decoder, Encoder
from pipeline.conversation import Conversation, Refusal, WireSession
from pipeline.calls import ToolResultError
from pipeline.engines import Backends, EngineUnavailable, ToolCall
from pipeline.errors import CLIENT_CAUSED, E_ENGINE_UNAVAILABLE, E_TOOL_RESULT_TOO_LARGE
from pipeline.history import Item, UnknownItem, new_id
from pipeline.protocol import MAX_WS_MESSAGE_BYTES
from pipeline.realtime import events as E
from pipeline.realtime import settings as S
from pipeline.reply import CANCELLED, COMPLETED, FAILED, INCOMPLETE, Reply
from pipeline.session_config import SessionConfig

log = logging.getLogger(__name__)

# One input_audio_buffer.append's audio (base64): what fits in the proxy's largest message (OpenAI
# allows 15 MiB; 240 KiB of base64 is 3.7 s of 24 kHz audio, far above what clients send at once).
MAX_APPEND_CHARS = 240 * 1024
# A client event's JSON text: the door's largest message for the events that carry audio (an append,
# an item of input_audio, a session's voice clip), 64 KiB (v1's largest frame) for every other.
MAX_EVENT_CHARS = 64 * 1024
AUDIO_EVENTS = ("input_audio_buffer.append", "conversation.item.create", "session.update")
PIECE = ENGINE_INPUT_RATE  # engine-rate samples handed to the core at a time (1 s, as v1's frames)
# AgentSettings fields -> where they live in the Realtime session object (for errors' ``param``)
AGENT_PARAMS = {"instructions": "session.instructions", "voice": "session.audio.output.voice",
                "modalities": "session.output_modalities", "max_output_tokens": "session.max_output_tokens",
                "temperature": "session.temperature", "tools": "session.tools", "tool_choice": "session.tool_choice"}


class ClientEventError(Exception):
    """A client event this session refuses: one ``error`` event, nothing changes."""

    def __init__(self, code: str, message: str, param: str | None = None):
        super().__init__(message)
        self.code, self.message, self.param = code, message, param


def _monotonic() -> float:
    return time.monotonic()


@dataclass
class _ReplyWire:
    """What the wire needs of one reply besides the core's Reply."""

    encoder: Encoder
    speaks: bool
    voice: str
    metadata: dict | None
    output_format: dict
    max_output_tokens: Any


class RealtimeSession(WireSession):
    def __init__(self, send: Callable[[str], Awaitable[None]], backends: Backends, cfg: SessionConfig | None = None,
                 session_id: str | None = None, smart_turn=None, voices: tuple[str, ...] = (DEFAULT_VOICE,),
                 model: str = "gapless", beta: bool = False):
        self.server_cfg = cfg or SessionConfig()
        self.core = Conversation(self, backends, self.server_cfg, session_id or new_id("sess"), smart_turn, voices,
                                 clock=_monotonic)
        self.id = self.core.id
        self.beta = beta
        self._send_raw = send
        self._send_lock = asyncio.Lock()
        self.session = S.initial(self.id, model, self.server_cfg)
        self.terms = self._apply(self.session)
        self._voice_clip: dict | None = None  # what session.updated says of the session's own clip
        self._decoder = Decoder(self.terms.input_format)
        self._buffered_s = 0.0  # seconds of user audio since the last committed turn
        self._replies: dict[str, _ReplyWire] = {}
        self._pending_metadata: dict | None = None
        self._client_event_id: str | None = None  # the event being handled (errors name it)

    # ------------------------------------------------------------------ connection interface
    async def start(self) -> None:
        await self.emit({"type": "session.created", "session": self.describe()})

    @staticmethod
    def error_frame(code: str, message: str) -> str:
        """An error event for a connection refused before any session exists."""
        return json.dumps({"event_id": new_id("event"), **E.error(E.SERVER_ERROR, code, message)})

    async def emit(self, event: dict) -> None:
        if self.core.closed and event["type"] != "error":
            return
        event = {"event_id": new_id("event"), **(E.beta(event) if self.beta else event)}
        async with self._send_lock:
            await self._send_raw(json.dumps(event))
        self.core.touch()

    def describe(self) -> dict:
        session = copy.deepcopy(self.session)
        if self._voice_clip is not None:
            session["audio"]["output"]["voice_clip"] = self._voice_clip
        if self.beta:  # the flat fields a beta client reads, beside the GA ones
            audio = session["audio"]
            session.update(modalities=["text", "audio"] if session["output_modalities"] == ["audio"] else ["text"],
                           voice=audio["output"].get("voice"), turn_detection=audio["input"].get("turn_detection"),
                           input_audio_transcription=audio["input"].get("transcription"),
                           input_audio_format=_beta_format(audio["input"]["format"]),
                           output_audio_format=_beta_format(audio["output"]["format"]))
        return session

    # ------------------------------------------------------------------ client events
    async def on_frame(self, frame: bytes | str) -> None:
        """One client event. Anything wrong with it costs one ``error`` event, nothing more."""
        self.core.touch()
        self._client_event_id = None
        try:
            event = self._parse(frame)
            self._client_event_id = event.get("event_id") if isinstance(event.get("event_id"), str) else None
            self._check_size(event, frame)
            handler = self.HANDLERS.get(event["type"])
            if handler is None:
                raise ClientEventError("unknown_event", f"unknown or unsupported client event type {event['type']!r}")
            await handler(self, event)
        except ClientEventError as exc:
            await self._refuse(exc.code, exc.message, exc.param)
        except BadSetting as exc:
            await self._refuse("invalid_value", exc.message,
                               AGENT_PARAMS.get(exc.param, exc.param if exc.param.startswith(("session", "response"))
                                                else f"session.{exc.param}"))
        except Refusal as exc:  # the core's limits (item size, audio allowance, response rate)
            await self._refuse(exc.code, exc.message, exc.param)
        finally:
            self._client_event_id = None

    @staticmethod
    def _parse(frame: bytes | str) -> dict:
        if not isinstance(frame, str):
            raise ClientEventError("invalid_json", "send JSON text frames (this endpoint speaks the Realtime "
                                                   "protocol; binary msgpack is /v1/conversation's)")
        if len(frame) > MAX_WS_MESSAGE_BYTES:
            raise ClientEventError("event_too_large", f"a client event is at most {MAX_WS_MESSAGE_BYTES} "
                                                      f"characters; got {len(frame)}")
        try:
            event = json.loads(frame)
        except RecursionError:
            raise ClientEventError("invalid_json", "the frame's JSON is nested too deeply") from None
        except ValueError as exc:
            raise ClientEventError("invalid_json", f"the frame is not JSON: {exc}") from None
        if not isinstance(event, dict) or not isinstance(event.get("type"), str):
            raise ClientEventError("invalid_event", "a client event is a JSON object with a string \"type\"")
        return event

    @staticmethod
    def _check_size(event: dict, frame: str) -> None:
        limit = MAX_WS_MESSAGE_BYTES if event["type"] in AUDIO_EVENTS else MAX_EVENT_CHARS
        if len(frame) > limit:
            raise ClientEventError("event_too_large", f"a {event['type']} event is at most {limit} characters; "
                                                      f"got {len(frame)}")

    async def _refuse(self, code: str, message: str, param: str | None = None) -> None:
        if self.cfg.on_error:
            self.cfg.on_error(code)
        await self.emit(E.error(E.INVALID_REQUEST, code, message, param, self._client_event_id))

    async def _session_update(self, event: dict) -> None:
        update = _object(event, "session")
        if self.beta:
            update = S.from_beta(update)
        update = S.known(update)
        clip = ((update.get("audio") or {}).get("output") or {}).pop("voice_clip", None)
        merged = S.deep_merge(self.session, update)
        S.check_size(merged)
        terms = self._check(merged)
        reference = await self._encode_clip(clip) if clip is not None else None
        self.session, self.terms = merged, terms
        self._apply(merged, reference)
        if reference is not None:
            self._voice_clip = {"transcript": reference.text, "seconds": round(len(reference.codes) * 0.08, 2)}
        elif self.core.agent.voice_reference is None:
            self._voice_clip = None
        if self._decoder.format != terms.input_format:
            self._decoder = Decoder(terms.input_format)
        await self.emit({"type": "session.updated", "session": self.describe()})

    def _check(self, session: dict) -> S.SessionTerms:
        terms = S.apply(session, self.server_cfg)
        self.core.agent.updated(terms.agent, self.core.voices)  # raises BadSetting, changing nothing
        return terms

    def _apply(self, session: dict, reference=None) -> S.SessionTerms:
        terms = S.apply(session, self.server_cfg)
        self.core.configure(**terms.turn_taking)
        self.core.update(terms.agent if reference is None else {**terms.agent, "voice_reference": reference})
        self.core.reply_on_turn_end = terms.reply_on_turn_end
        return terms

    async def _encode_clip(self, clip: Any):
        """Our extension ``session.audio.output.voice_clip``: {audio: base64 pcm16 24 kHz, transcript}."""
        param = "session.audio.output.voice_clip"
        if not isinstance(clip, dict) or not isinstance(clip.get("transcript"), str) or not clip["transcript"].strip():
            raise ClientEventError("invalid_value", f"{param} needs audio (base64 pcm16 24 kHz) and its transcript", param)
        if len(clip["transcript"]) > MAX_VOICE_CLIP_TEXT:
            raise ClientEventError("invalid_value", f"{param}.transcript is over {MAX_VOICE_CLIP_TEXT} characters", param)
        data = _base64(clip.get("audio"), f"{param}.audio")
        if len(data) % 2:
            raise ClientEventError("invalid_value", f"{param}.audio is pcm16: an even number of bytes, got "
                                                    f"{len(data)}", param)
        pcm = np.frombuffer(data, dtype="<i2").astype(np.int16)
        if not len(pcm) or len(pcm) > MAX_VOICE_CLIP_S * 24_000:
            raise ClientEventError("invalid_value", f"{param}.audio must hold up to {MAX_VOICE_CLIP_S:g} s of pcm16 "
                                                    "at 24 kHz", param)
        try:
            return await self.core.encode_voice_clip(pcm, clip["transcript"].strip())
        except EngineUnavailable as exc:
            raise ClientEventError(E_ENGINE_UNAVAILABLE, f"the voice clip could not be encoded ({exc})", param) from None

    async def _append(self, event: dict) -> None:
        audio = event.get("audio")
        if not isinstance(audio, str):
            raise ClientEventError("invalid_value", "input_audio_buffer.append needs audio (a base64 string)", "audio")
        if len(audio) > MAX_APPEND_CHARS:
            raise ClientEventError("input_audio_buffer_append_too_large",
                                   f"an append's audio is at most {MAX_APPEND_CHARS} characters of base64 "
                                   f"(240 KiB); got {len(audio)}", "audio")
        try:
            pcm = self._decoder.decode(_base64(audio, "audio"))
        except ValueError as exc:
            raise ClientEventError("invalid_value", str(exc), "audio") from None
        await self._hear(pcm)

    async def _hear(self, pcm: np.ndarray) -> None:
        self._buffered_s += len(pcm) / ENGINE_INPUT_RATE
        for start in range(0, len(pcm), PIECE):
            await self.core.hear(pcm[start:start + PIECE])

    async def _commit(self, event: dict) -> None:
        await self._hear(self._decoder.flush())
        if not self.core.heard.open:
            raise ClientEventError("input_audio_buffer_commit_empty",
                                   "nothing to commit: no audio since the last turn (a VAD may have ended it already)")
        await self.core.end_turn(respond=self.terms.reply_on_turn_end and self.cfg.turn_detection == "vad")

    async def _clear(self, event: dict) -> None:
        await self.core.clear_audio()
        self._decoder = Decoder(self.terms.input_format)
        self._buffered_s = 0.0
        await self.emit({"type": "input_audio_buffer.cleared"})

    async def _item_create(self, event: dict) -> None:
        item = _object(event, "item")
        after = event.get("previous_item_id")
        if after is not None and after != "root":
            self._known(after)
        role, kind = item.get("role"), item.get("type", "message")
        if kind in ("function_call", "function_call_output"):
            await self._announce(await self._call_item(item, kind, after), after)
            return
        if kind != "message" or role not in ("user", "assistant"):
            raise ClientEventError("invalid_value", f"items of type {kind!r} with role {role!r} are not supported "
                                                    "(user and assistant messages, function calls and their "
                                                    "outputs are)", "item")
        content = item.get("content")
        if not isinstance(content, list) or not content or not all(isinstance(p, dict) for p in content):
            raise ClientEventError("invalid_value", "item.content must be a non-empty list of content parts", "item.content")
        kinds = {p.get("type") for p in content}
        if role == "user" and kinds == {"input_audio"}:
            try:
                pcm = np.concatenate([Decoder(self.terms.input_format).decode(_base64(p.get("audio"),
                                                                                      "item.content.audio"))
                                      for p in content])
            except ValueError as exc:
                raise ClientEventError("invalid_value", str(exc), "item.content.audio") from None
            try:
                added = await self.core.add_user_audio(pcm, after)
            except EngineUnavailable as exc:
                raise ClientEventError(E_ENGINE_UNAVAILABLE, f"the recogniser could not hear this item ({exc})") from None
            await self._announce_user(added, after, len(pcm) / ENGINE_INPUT_RATE)
            return
        text_kinds = {"input_text"} if role == "user" else {"output_text", "text"}
        if not kinds <= text_kinds or not all(isinstance(p.get("text"), str) for p in content):
            raise ClientEventError("invalid_value", f"{role} message content must be {sorted(text_kinds)} parts with "
                                                    "text (or, for users, input_audio parts)", "item.content")
        text = " ".join(p["text"] for p in content)
        await self._announce(await self.core.add_item(Item(role, text, id=_item_id(item)), after), after)

    async def _announce(self, added: Item, after: str | None) -> None:
        previous = self.core.history.previous_id(added) if added in self.core.history.items else after
        await self.emit({"type": "conversation.item.added", "previous_item_id": previous, "item": E.item(added)})
        await self.emit({"type": "conversation.item.done", "previous_item_id": previous, "item": E.item(added)})

    async def _call_item(self, item: dict, kind: str, after: str | None) -> Item:
        """A function call's output (the client ran the tool), or a call the client adds to the
        history itself; no response starts (``response.create`` asks for one)."""
        call_id = item.get("call_id")
        if not isinstance(call_id, str) or not call_id:
            raise ClientEventError("invalid_value", f"a {kind} item needs its call_id", "item.call_id")
        if kind == "function_call":
            name, arguments = item.get("name"), item.get("arguments", "{}")
            if not isinstance(name, str) or not isinstance(arguments, str):
                raise ClientEventError("invalid_value", "a function_call item needs a name and arguments (a string)",
                                       "item")
            return await self.core.add_item(Item.call(call_id, name, arguments), after)
        output = item.get("output")
        if not isinstance(output, str):
            raise ClientEventError("invalid_value", "a function_call_output item needs its output (a string)",
                                   "item.output")
        try:
            return await self.core.tool_result(call_id, output)
        except ToolResultError as exc:
            raise ClientEventError(exc.code, exc.message, "item.call_id" if exc.code != E_TOOL_RESULT_TOO_LARGE
                                   else "item.output") from None

    def _known(self, item_id: Any) -> Item:
        try:
            return self.core.history.get(item_id)
        except UnknownItem:
            raise ClientEventError("item_not_found", f"no item {item_id!r} in this conversation", "item_id") from None

    async def _item_retrieve(self, event: dict) -> None:
        reply = self.core.reply
        if reply is not None and reply.running and reply.item_id == event.get("item_id"):
            wire = self._replies.get(reply.id)
            found = E.reply_item(reply.item_id, wire is not None and wire.speaks, reply.said, "in_progress")
        else:
            found = E.item(self._known(event.get("item_id")))
        await self.emit({"type": "conversation.item.retrieved", "item": found})

    async def _item_delete(self, event: dict) -> None:
        self._known(event.get("item_id"))
        self.core.delete(event["item_id"])
        await self.emit({"type": "conversation.item.deleted", "item_id": event["item_id"]})

    async def _item_truncate(self, event: dict) -> None:
        item_id, end = event.get("item_id"), event.get("audio_end_ms")
        if isinstance(end, bool) or not isinstance(end, int) or end < 0:
            raise ClientEventError("invalid_value", "audio_end_ms must be a non-negative integer", "audio_end_ms")
        if not (self.core.reply is not None and self.core.reply.item_id == item_id):
            self._known(item_id)
        try:
            await self.core.truncate(item_id, end)
        except UnknownItem:
            raise ClientEventError("item_not_found", f"no item {item_id!r} in this conversation", "item_id") from None
        except ValueError as exc:
            raise ClientEventError("invalid_value", str(exc), "audio_end_ms") from None
        await self.emit({"type": "conversation.item.truncated", "item_id": item_id,
                         "content_index": event.get("content_index", 0), "audio_end_ms": end})

    async def _response_create(self, event: dict) -> None:
        if self.core.reply is not None and self.core.reply.running:
            raise ClientEventError("conversation_already_has_active_response",
                                   f"response {self.core.reply.id} is still in progress; cancel it or wait for its "
                                   "response.done")
        params = event.get("response") or {}
        if not isinstance(params, dict):
            raise ClientEventError("invalid_value", "response must be an object", "response")
        overrides = S.response_overrides(params)
        self.core.agent.updated(overrides, self.core.voices)  # raises BadSetting before anything starts
        self._pending_metadata = params.get("metadata")
        await self.core.respond(overrides)

    async def _response_cancel(self, event: dict) -> None:
        reply = self.core.reply
        wanted = event.get("response_id")
        if reply is None or not reply.running or (wanted is not None and wanted != reply.id):
            raise ClientEventError("response_cancel_not_active", "there is no active response to cancel", "response_id")
        await self.core.cancel_reply()

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

    # ------------------------------------------------------------------ ConversationEvents
    async def speech(self, kind: str, audio_ms: float, item_id: str) -> None:
        if kind == "speech.started":
            await self.emit({"type": "input_audio_buffer.speech_started", "audio_start_ms": int(audio_ms),
                             "item_id": item_id})
        else:
            await self.emit({"type": "input_audio_buffer.speech_stopped", "audio_end_ms": int(audio_ms),
                             "item_id": item_id})

    async def transcript_delta(self, turn: int, item_id: str, delta: str, text: str) -> None:
        pass  # as OpenAI's, transcription events follow the commit (turn_ended)

    async def turn_ended(self, turn: int, item: Item, text: str, words: list[dict] | None) -> None:
        seconds, self._buffered_s = self._buffered_s, 0.0
        previous = self.core.history.previous_id(item) if item in self.core.history.items else \
            (self.core.history.last.id if self.core.history.last else None)
        await self.emit({"type": "input_audio_buffer.committed", "item_id": item.id, "previous_item_id": previous})
        await self._announce_user(item, previous, seconds)

    async def _announce_user(self, item: Item, previous: str | None, seconds: float) -> None:
        await self.emit({"type": "conversation.item.added", "previous_item_id": previous, "item": E.item(item)})
        await self.emit({"type": "conversation.item.done", "previous_item_id": previous, "item": E.item(item)})
        if self.terms.transcription:
            if item.text:
                await self.emit({"type": "conversation.item.input_audio_transcription.delta", "item_id": item.id,
                                 "content_index": 0, "delta": item.text})
            await self.emit({"type": "conversation.item.input_audio_transcription.completed", "item_id": item.id,
                             "content_index": 0, "transcript": item.text,
                             "usage": {"type": "duration", "seconds": round(seconds, 3)}})

    @staticmethod
    def _response(reply: Reply, wire: _ReplyWire, status: str, output: list[dict], details: dict | None = None,
                  usage: dict | None = None) -> dict:
        return E.response(reply.id, status, output, list(reply.settings.modalities), wire.voice, wire.output_format,
                          wire.max_output_tokens, wire.metadata, details, usage)

    async def reply_started(self, reply: Reply) -> None:
        speaks = reply.settings.speaks
        wire = self._replies[reply.id] = _ReplyWire(
            Encoder(self.terms.output_format), speaks, reply.settings.voice, self._pending_metadata,
            self.terms.output_format.describe(), reply.settings.max_output_tokens or "inf")
        self._pending_metadata = None
        await self.emit({"type": "response.created", "response": self._response(reply, wire, "in_progress", [])})
        if reply.messages is None:
            return
        previous = self.core.history.last.id if self.core.history.last else None
        started = E.reply_item(reply.item_id, speaks, None, "in_progress")
        await self.emit({"type": "response.output_item.added", "response_id": reply.id, "output_index": 0,
                         "item": started})
        await self.emit({"type": "conversation.item.added", "previous_item_id": previous, "item": started})
        part = {"type": "audio", "transcript": ""} if wire.speaks else {"type": "text", "text": ""}
        await self.emit({"type": "response.content_part.added", **self._at(reply), "part": part})

    @staticmethod
    def _at(reply: Reply) -> dict:
        return {"response_id": reply.id, "item_id": reply.item_id, "output_index": 0, "content_index": 0}

    async def reply_text(self, reply: Reply, delta: str) -> None:
        kind = "response.output_audio_transcript.delta" if self._replies[reply.id].speaks else "response.output_text.delta"
        await self.emit({"type": kind, **self._at(reply), "delta": delta})

    async def reply_audio(self, reply: Reply, pcm: np.ndarray, seq: int) -> None:
        data = self._replies[reply.id].encoder.encode(pcm)
        await self.emit({"type": "response.output_audio.delta", **self._at(reply),
                         "delta": base64.b64encode(data).decode("ascii")})

    async def reply_paused(self, reply: Reply) -> None:
        pass  # the Realtime protocol has no such event: its client plays out what it has, then waits

    async def reply_resumed(self, reply: Reply) -> None:
        pass

    async def reply_done(self, reply: Reply) -> None:
        wire = self._replies.pop(reply.id)
        output: list[dict] = []
        if reply.messages is not None:
            transcript = reply.said if reply.status == CANCELLED else reply.text.strip()
            status = "completed" if reply.status == COMPLETED else "incomplete"
            at = self._at(reply)
            if wire.speaks:
                tail = wire.encoder.encode(np.zeros(0, np.int16), last=True)
                if tail:
                    await self.emit({"type": "response.output_audio.delta", **at,
                                     "delta": base64.b64encode(tail).decode("ascii")})
                await self.emit({"type": "response.output_audio.done", **at})
                await self.emit({"type": "response.output_audio_transcript.done", **at, "transcript": transcript})
                part = {"type": "audio", "transcript": transcript}
            else:
                await self.emit({"type": "response.output_text.done", **at, "text": transcript})
                part = {"type": "text", "text": transcript}
            await self.emit({"type": "response.content_part.done", **at, "part": part})
            item = E.reply_item(reply.item_id, wire.speaks, transcript, status)
            await self.emit({"type": "conversation.item.done", "previous_item_id": None, "item": item})
            await self.emit({"type": "response.output_item.done", "response_id": reply.id, "output_index": 0,
                             "item": item})
            output = [item, *(E.item(it) for it in map(self.core.history.call, (c.call_id for c in reply.calls))
                              if it is not None)]
        details = {COMPLETED: None,
                   CANCELLED: {"type": "cancelled", "reason": reply.reason},
                   INCOMPLETE: {"type": "incomplete", "reason": reply.reason},
                   FAILED: {"type": "failed", "error": {"type": E.SERVER_ERROR, "code": reply.reason}}}[reply.status]
        usage = E.usage(*reply.usage) if reply.usage else None
        await self.emit({"type": "response.done",
                         "response": self._response(reply, wire, reply.status, output, details, usage)})

    async def tool_call(self, reply: Reply, call: ToolCall, item: Item) -> None:
        """A function call of the running response, whole (its arguments in one delta): the client
        runs it, then sends its output (``conversation.item.create``) and ``response.create``."""
        at = {"response_id": reply.id, "output_index": len(reply.calls)}  # the message item is output 0
        previous = self.core.history.previous_id(item)
        await self.emit({"type": "response.output_item.added", **at, "item": E.item(item, "in_progress")})
        await self.emit({"type": "conversation.item.added", "previous_item_id": previous,
                         "item": E.item(item, "in_progress")})
        args = {**at, "item_id": item.id, "call_id": call.call_id}
        await self.emit({"type": "response.function_call_arguments.delta", **args, "delta": call.arguments})
        await self.emit({"type": "response.function_call_arguments.done", **args, "name": call.name,
                         "arguments": call.arguments})
        await self.emit({"type": "conversation.item.done", "previous_item_id": previous, "item": E.item(item)})
        await self.emit({"type": "response.output_item.done", **at, "item": E.item(item)})

    async def tool_cancelled(self, call: ToolCall, turn: int, reason: str) -> None:
        pass  # the protocol has no event for it: a late output for the call gets an error (call_cancelled)

    async def error(self, code: str, message: str) -> None:
        kind = E.INVALID_REQUEST if code in CLIENT_CAUSED else E.SERVER_ERROR
        await self.emit(E.error(kind, code, message, None, self._client_event_id))


def _object(event: dict, name: str) -> dict:
    value = event.get(name)
    if not isinstance(value, dict):
        raise ClientEventError("invalid_value", f"{event['type']} needs {name} (an object)", name)
    return value


def _base64(value: Any, param: str) -> bytes:
    if not isinstance(value, str):
        raise ClientEventError("invalid_value", f"{param} must be a base64 string", param)
    try:
        return base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        raise ClientEventError("invalid_base64", f"{param} is not valid base64", param) from None


def _item_id(item: dict) -> str:
    given = item.get("id")
    return given if isinstance(given, str) and given else new_id("item")


def _beta_format(fmt: dict) -> str:
    return {"audio/pcm": "pcm16", "audio/pcmu": "g711_ulaw", "audio/pcma": "g711_alaw"}.get(fmt.get("type"), "pcm16")
