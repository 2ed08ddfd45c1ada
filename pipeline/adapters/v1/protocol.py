"""WebSocket protocol v1: message types, parsing and validation (see docs/protocol.md).

Every message, both ways, is one binary WebSocket frame holding one msgpack map with a
string ``type``. Parsing never raises anything but :class:`ProtocolError`, whose ``code``
is part of the public contract (clients match on it), so one malformed frame gets one
``error`` message and nothing else happens.
"""
from __future__ import annotations

from dataclasses import dataclass

import msgpack
import numpy as np

from pipeline.audio_constants import REPLY_RATE, USER_RATE
from pipeline.errors import (  # noqa: F401 - the conversation's codes, as v1 sends them (P.E_...)
    E_AUDIO_TOO_FAST, E_BAD_OPTION, E_BAD_SETTING, E_ENGINE_UNAVAILABLE, E_IDLE_TIMEOUT, E_INTERNAL, E_ITEM_TOO_LARGE,
    E_NO_FREE_SLOT, E_RATE_LIMITED, E_RESUME_REFUSED, E_SERVER_BUSY, E_SESSION_REPLACED, E_TOOL_RESULT_TOO_LARGE,
    E_TURN_TOO_LONG, CLOSE_INTERNAL_ERROR, CLOSE_NORMAL, CLOSE_POLICY_VIOLATION, CLOSE_SERVICE_RESTART,
    CLOSE_SESSION_REPLACED, CLOSE_TRY_AGAIN_LATER)

PROTOCOL_VERSION = 1
MAX_AUDIO_SECONDS = 1.0
MAX_AUDIO_BYTES = int(USER_RATE * MAX_AUDIO_SECONDS) * 2
MAX_TEXT_CHARS = 4_000
MAX_VOICE_CLIP_BYTES = REPLY_RATE * 2  # voice.clip audio: int16 mono at REPLY_RATE, at most 1 s a frame
# v1 names of the agent settings (session.update, a turn's ``response``) -> pipeline.conversation.agent.AgentSettings fields
SETTINGS = {"instructions": "instructions", "voice": "voice", "temperature": "temperature",
            "max_output_tokens": "max_output_tokens", "output_modalities": "modalities", "tools": "tools",
            "tool_choice": "tool_choice", "tool_filler": "tool_filler", "tool_filler_after_ms": "tool_filler_after_ms",
            "language": "language"}
# Largest frame we read at all: one second of audio plus msgpack overhead, with room to spare.
MAX_FRAME_BYTES = 64 * 1024
# Largest WebSocket message the server's proxy reads at all, on any route (v1 frames over
# MAX_FRAME_BYTES but under this get frame_too_large; over it, the connection is closed with 1009
# before the message is read: deployments/proxy_limits.py).
MAX_WS_MESSAGE_BYTES = 256 * 1024

# Stable error codes (docs/protocol.md lists them with their meaning): the conversation's come from
# the one catalogue (pipeline/errors.py, imported above); these are v1's framing's own.
E_TEXT_FRAME = "text_frame"            # a text WebSocket frame; the protocol is binary msgpack
E_FRAME_TOO_LARGE = "frame_too_large"  # a frame over MAX_FRAME_BYTES
E_BAD_MSGPACK = "bad_msgpack"          # the frame is not one msgpack object
E_NOT_A_MAP = "not_a_map"              # msgpack, but not a map
E_MISSING_FIELD = "missing_field"      # a required field (``type`` included) is absent
E_WRONG_TYPE = "wrong_type"            # a field has the wrong type
E_UNKNOWN_TYPE = "unknown_type"        # ``type`` names no client message
E_BAD_AUDIO = "bad_audio"              # pcm is empty, odd-length, or longer than 1 s
E_TEXT_TOO_LONG = "text_too_long"      # a text turn over MAX_TEXT_CHARS



class ProtocolError(Exception):
    """A client message the server cannot accept; ``code`` is stable, ``message`` is for humans."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code
        self.message = message


# ----------------------------------------------------------------------------- client -> server
@dataclass(frozen=True)
class AudioIn:
    pcm: np.ndarray  # int16, mono, 16 kHz, contiguous


@dataclass(frozen=True)
class TextIn:
    text: str
    response: dict | None = None  # settings for this turn's reply only (AgentSettings field names)


@dataclass(frozen=True)
class TurnEnd:
    response: dict | None = None


@dataclass(frozen=True)
class SessionUpdate:
    settings: dict  # AgentSettings field names -> values, not yet checked


@dataclass(frozen=True)
class VoiceClip:
    pcm: np.ndarray  # int16, mono, 24 kHz: the next piece of the session's reference clip
    text: str | None  # with done: the clip's transcript
    done: bool


@dataclass(frozen=True)
class ToolResult:
    call_id: str
    output: str
    respond: bool  # the reply goes on with the results (else the turn's response ends)


ClientMessage = AudioIn | TextIn | TurnEnd | SessionUpdate | VoiceClip | ToolResult


def _field(msg: dict, name: str, kind: type | tuple[type, ...], type_name: str):
    if name not in msg:
        raise ProtocolError(E_MISSING_FIELD, f"message of type {msg.get('type')!r} needs field {name!r}")
    value = msg[name]
    if not isinstance(value, kind):
        raise ProtocolError(
            E_WRONG_TYPE, f"field {name!r} must be {type_name}, got {type(value).__name__}"
        )
    return value


def parse_client_frame(frame: bytes | str) -> ClientMessage:
    """Validate one WebSocket frame from a client; raise :class:`ProtocolError` if it is bad."""
    # Over 40 lines as one function: one case per v1 message, as docs/protocol.md lists them.
    if isinstance(frame, str):
        raise ProtocolError(E_TEXT_FRAME, "send binary frames holding msgpack maps, not text frames")
    if len(frame) > MAX_FRAME_BYTES:
        raise ProtocolError(E_FRAME_TOO_LARGE, f"frame of {len(frame)} bytes exceeds {MAX_FRAME_BYTES}")
    try:
        msg = msgpack.unpackb(frame, raw=False, strict_map_key=True)
    except Exception as exc:  # noqa: BLE001 - msgpack raises several unrelated types
        raise ProtocolError(E_BAD_MSGPACK, f"frame is not a msgpack object: {type(exc).__name__}") from None
    if not isinstance(msg, dict):
        raise ProtocolError(E_NOT_A_MAP, f"message must be a msgpack map, got {type(msg).__name__}")
    kind = _field(msg, "type", str, "a string")
    if kind == "audio":
        pcm = _field(msg, "pcm", bytes, "bytes (int16 LE mono 16 kHz)")
        if not pcm or len(pcm) % 2 or len(pcm) > MAX_AUDIO_BYTES:
            raise ProtocolError(
                E_BAD_AUDIO,
                f"pcm must be a non-empty, even number of bytes up to {MAX_AUDIO_BYTES} "
                f"(1 s of int16 at 16 kHz); got {len(pcm)}",
            )
        return AudioIn(np.frombuffer(pcm, dtype="<i2").astype(np.int16, copy=True))
    if kind == "text":
        text = _field(msg, "text", str, "a string")
        if len(text) > MAX_TEXT_CHARS:
            raise ProtocolError(E_TEXT_TOO_LONG, f"text of {len(text)} characters exceeds {MAX_TEXT_CHARS}")
        return TextIn(text, _response_settings(msg))
    if kind == "turn.end":
        return TurnEnd(_response_settings(msg))
    if kind == "session.update":
        return SessionUpdate(_settings({k: v for k, v in msg.items() if k != "type"}))
    if kind == "voice.clip":
        pcm = msg.get("pcm", b"")
        if not isinstance(pcm, bytes) or len(pcm) % 2 or len(pcm) > MAX_VOICE_CLIP_BYTES:
            raise ProtocolError(E_BAD_AUDIO, f"voice.clip pcm must be bytes of int16 at {REPLY_RATE} Hz, an even "
                                             f"number up to {MAX_VOICE_CLIP_BYTES} (1 s)")
        done = msg.get("done", False)
        text = msg.get("text")
        if not isinstance(done, bool) or (text is not None and not isinstance(text, str)):
            raise ProtocolError(E_WRONG_TYPE, "voice.clip: done must be a boolean and text a string")
        if done and not text:
            raise ProtocolError(E_MISSING_FIELD, "the last voice.clip frame (done: true) needs the clip's text")
        return VoiceClip(np.frombuffer(pcm, dtype="<i2").astype(np.int16, copy=True), text, done)
    if kind == "tool.result":
        respond = msg.get("respond", True)
        if not isinstance(respond, bool):
            raise ProtocolError(E_WRONG_TYPE, f"field 'respond' must be a boolean, got {type(respond).__name__}")
        return ToolResult(_field(msg, "call_id", str, "a string"), _field(msg, "output", str, "a string"), respond)
    raise ProtocolError(E_UNKNOWN_TYPE, f"unknown message type {kind!r} (expected audio, text, turn.end, "
                                        "session.update, voice.clip, tool.result)")


def _settings(given: dict) -> dict:
    """v1 setting names -> AgentSettings fields; an unknown name is a bad_setting."""
    unknown = sorted(set(given) - set(SETTINGS))
    if unknown:
        raise ProtocolError(E_BAD_SETTING, f"unknown setting {unknown[0]!r}; known: {sorted(SETTINGS)}")
    return {SETTINGS[k]: v for k, v in given.items()}


def _response_settings(msg: dict) -> dict | None:
    if "response" not in msg:
        return None
    return _settings(_field(msg, "response", dict, "a map of settings"))


# ----------------------------------------------------------------------------- server -> client
def pack(msg: dict) -> bytes:
    return msgpack.packb(msg, use_bin_type=True)


def session_ready(session_id: str, resume: dict | None = None, voices: tuple[str, ...] | None = None,
                  languages: dict | None = None) -> dict:
    """``resume`` (v1 extension, where the server keeps sessions resumable): ``resume_token``,
    ``resume_window_s``, and on a resumed session ``resumed: true`` and ``turn`` (its last turn).
    ``voices`` (v1 extension): the voice names a session may choose. ``languages`` (v1 extension):
    ``languages`` (the codes the recogniser hears) and ``voice_languages`` (voice -> its languages)."""
    return {
        "type": "session.ready",
        "session_id": session_id,
        "input_sample_rate": USER_RATE,
        "output_sample_rate": REPLY_RATE,
        "protocol_version": PROTOCOL_VERSION,
        **({"voices": list(voices)} if voices else {}),
        **(languages or {}),
        **(resume or {}),
    }


def going_away(resume_token: str | None, reason: str) -> dict:
    """(v1 extension) this gateway replica is stopping: the session is closed next (1012) and may
    be resumed at once, on another replica, with ``resume_token``."""
    return {"type": "going_away", "reason": reason, "resume_token": resume_token}


def transcript_partial(text: str, turn: int) -> dict:
    return {"type": "transcript.partial", "text": text, "turn": turn}


def transcript_final(text: str, turn: int, words: list[dict] | None = None) -> dict:
    """``words`` (v1 extension, spoken turns): [{"word", "start_ms", "end_ms"}], ms from the turn's first audio."""
    msg = {"type": "transcript.final", "text": text, "turn": turn}
    if words is not None:
        msg["words"] = [{"word": w["word"], "start_ms": int(w["start_ms"]), "end_ms": int(w["end_ms"])} for w in words]
    return msg


def response_text(delta: str, turn: int) -> dict:
    return {"type": "response.text", "text": delta, "turn": turn}


def audio_out(pcm: np.ndarray, turn: int, seq: int) -> dict:
    pcm = np.ascontiguousarray(pcm, dtype="<i2")
    return {"type": "audio", "pcm": pcm.tobytes(), "turn": turn, "seq": seq}


def response_done(turn: int, interrupted: bool, timings: dict[str, float] | None = None) -> dict:
    msg = {"type": "response.done", "turn": turn, "interrupted": bool(interrupted)}
    if timings:  # optional extension: where the time to first audio went, ms after transcript.final
        msg["timings"] = {k: round(v, 1) for k, v in timings.items()}
    return msg


def response_paused(turn: int) -> dict:
    """(v1 extension, ``resume_false_interruption``) speech over the reply paused it: no more of its
    audio comes until ``response.resumed`` (play on from where it stopped) or ``response.done``."""
    return {"type": "response.paused", "turn": turn}


def response_resumed(turn: int) -> dict:
    """(v1 extension) the speech that paused the reply was no turn: its audio comes again."""
    return {"type": "response.resumed", "turn": turn}


def speech_event(kind: str, audio_ms: float) -> dict:
    """``speech.started`` / ``speech.stopped`` (v1 extension): the server's VAD, at ``audio_ms`` of
    this session's microphone audio (ms of audio received before the event's position)."""
    return {"type": kind, "audio_ms": int(audio_ms)}


def error(code: str, message: str, param: str | None = None) -> dict:
    msg = {"type": "error", "code": code, "message": message}
    if param is not None:  # (v1 extension) the setting a bad_setting error is about
        msg["param"] = param
    return msg


def tool_call(call_id: str, name: str, arguments: str, turn: int) -> dict:
    """(v1 extension) the LLM called a tool: the client runs it and answers with ``tool.result``."""
    return {"type": "tool.call", "call_id": call_id, "name": name, "arguments": arguments, "turn": turn}


def tool_cancelled(call_id: str, turn: int, reason: str) -> dict:
    """(v1 extension) a call's result is no longer wanted: ``cancelled`` (the user spoke) or ``timeout``."""
    return {"type": "tool.cancelled", "call_id": call_id, "turn": turn, "reason": reason}


def session_updated(settings: dict) -> dict:
    """(v1 extension) the agent settings now in force, after ``session.update`` or a voice clip."""
    return {"type": "session.updated", "settings": settings}


def client_audio(pcm: np.ndarray) -> bytes:
    """Client side helper: one ``audio`` frame from int16 samples."""
    return pack({"type": "audio", "pcm": np.ascontiguousarray(pcm, dtype="<i2").tobytes()})


def client_text(text: str) -> bytes:
    return pack({"type": "text", "text": text})


def client_turn_end() -> bytes:
    return pack({"type": "turn.end"})


def unpack(frame: bytes) -> dict:
    """Client side helper: decode one server frame."""
    return msgpack.unpackb(frame, raw=False)
