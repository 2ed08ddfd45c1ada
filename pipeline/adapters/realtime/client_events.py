"""The Realtime protocol's client events, read: JSON text frames checked and decoded into what the
conversation core takes (commands, items, audio). Readers only: nothing here changes a session;
anything wrong raises :class:`ClientEventError`, which the session sends as one ``error`` event.
"""
from __future__ import annotations

import base64
import binascii
import json
from typing import Any

import numpy as np

from pipeline.adapters.audio_formats import Decoder
from pipeline.conversation import commands as C
from pipeline.conversation.history import Item, new_id
from pipeline.adapters.v1.protocol import MAX_WS_MESSAGE_BYTES

# One input_audio_buffer.append's audio (base64): what fits in the proxy's largest message (OpenAI
# allows 15 MiB; 240 KiB of base64 is 3.7 s of 24 kHz audio, far above what clients send at once).
MAX_APPEND_CHARS = 240 * 1024
# A client event's JSON text: the door's largest message for the events that carry audio (an append,
# an item of input_audio, a session's voice clip), 64 KiB (v1's largest frame) for every other.
MAX_EVENT_CHARS = 64 * 1024
AUDIO_EVENTS = ("input_audio_buffer.append", "conversation.item.create", "session.update")


class ClientEventError(Exception):
    """A client event this session refuses: one ``error`` event, nothing changes."""

    def __init__(self, code: str, message: str, param: str | None = None):
        super().__init__(message)
        self.code, self.message, self.param = code, message, param


def parse(frame: bytes | str) -> dict:
    """A client event: a JSON object with a string ``type``, within its size."""
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


def event_id(event: dict) -> str | None:
    return event.get("event_id") if isinstance(event.get("event_id"), str) else None


def check_size(event: dict, frame: str) -> None:
    limit = MAX_WS_MESSAGE_BYTES if event["type"] in AUDIO_EVENTS else MAX_EVENT_CHARS
    if len(frame) > limit:
        raise ClientEventError("event_too_large", f"a {event['type']} event is at most {limit} characters; "
                                                  f"got {len(frame)}")


def field_object(event: dict, name: str) -> dict:
    value = event.get(name)
    if not isinstance(value, dict):
        raise ClientEventError("invalid_value", f"{event['type']} needs {name} (an object)", name)
    return value


def b64(value: Any, param: str) -> bytes:
    if not isinstance(value, str):
        raise ClientEventError("invalid_value", f"{param} must be a base64 string", param)
    try:
        return base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        raise ClientEventError("invalid_base64", f"{param} is not valid base64", param) from None


def appended_audio(event: dict, decoder: Decoder) -> np.ndarray:
    """input_audio_buffer.append's audio, decoded to the engines' rate."""
    audio = event.get("audio")
    if not isinstance(audio, str):
        raise ClientEventError("invalid_value", "input_audio_buffer.append needs audio (a base64 string)", "audio")
    if len(audio) > MAX_APPEND_CHARS:
        raise ClientEventError("input_audio_buffer_append_too_large",
                               f"an append's audio is at most {MAX_APPEND_CHARS} characters of base64 "
                               f"(240 KiB); got {len(audio)}", "audio")
    try:
        return decoder.decode(b64(audio, "audio"))
    except ValueError as exc:
        raise ClientEventError("invalid_value", str(exc), "audio") from None


def voice_clip(clip: Any) -> C.VoiceClip:
    """Our extension ``session.audio.output.voice_clip``: {audio: base64 pcm16 24 kHz, transcript}."""
    param = "session.audio.output.voice_clip"
    if not isinstance(clip, dict) or not isinstance(clip.get("transcript"), str):
        raise ClientEventError("invalid_value", f"{param} needs audio (base64 pcm16 24 kHz) and its transcript", param)
    data = b64(clip.get("audio"), f"{param}.audio")
    if len(data) % 2:
        raise ClientEventError("invalid_value", f"{param}.audio is pcm16: an even number of bytes, got {len(data)}",
                               param)
    return C.VoiceClip(np.frombuffer(data, dtype="<i2").astype(np.int16), clip["transcript"])


def item_command(event: dict, input_format) -> C.AddItem | C.AddUserAudio | C.ToolResult:
    """conversation.item.create as the command it asks for: a message, a call or a call's output."""
    item, after = field_object(event, "item"), event.get("previous_item_id")
    role, kind = item.get("role"), item.get("type", "message")
    if kind in ("function_call", "function_call_output"):
        return _call_item(item, kind, after)
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
            pcm = np.concatenate([Decoder(input_format).decode(b64(p.get("audio"), "item.content.audio"))
                                  for p in content])
        except ValueError as exc:
            raise ClientEventError("invalid_value", str(exc), "item.content.audio") from None
        return C.AddUserAudio(pcm, after)
    text_kinds = {"input_text"} if role == "user" else {"output_text", "text"}
    if not kinds <= text_kinds or not all(isinstance(p.get("text"), str) for p in content):
        raise ClientEventError("invalid_value", f"{role} message content must be {sorted(text_kinds)} parts with "
                                                "text (or, for users, input_audio parts)", "item.content")
    given = item.get("id")
    item_id = given if isinstance(given, str) and given else new_id("item")
    return C.AddItem(Item(role, " ".join(p["text"] for p in content), id=item_id), after)


def _call_item(item: dict, kind: str, after: str | None) -> C.AddItem | C.ToolResult:
    """A function call's output (the client ran the tool), or a call the client adds itself; no
    response starts (``response.create`` asks for one)."""
    call_id = item.get("call_id")
    if not isinstance(call_id, str) or not call_id:
        raise ClientEventError("invalid_value", f"a {kind} item needs its call_id", "item.call_id")
    if kind == "function_call":
        name, arguments = item.get("name"), item.get("arguments", "{}")
        if not isinstance(name, str) or not isinstance(arguments, str):
            raise ClientEventError("invalid_value", "a function_call item needs a name and arguments (a string)",
                                   "item")
        return C.AddItem(Item.call(call_id, name, arguments), after)
    output = item.get("output")
    if not isinstance(output, str):
        raise ClientEventError("invalid_value", "a function_call_output item needs its output (a string)",
                               "item.output")
    return C.ToolResult(call_id, output)
