"""Phone carriers' media streams, read and written: Twilio Media Streams and Telnyx media
streaming. Both are JSON text frames over a WebSocket the carrier opens: ``connected``, then
``start`` (the call, its audio format and the parameters the call's setup passed), then ``media``
(base64 G.711 at 8 kHz, 20 ms a frame), ``dtmf``, ``mark`` (a mark we sent, echoed once the audio
before it has played) and ``stop``; we send ``media``, ``mark`` and ``clear`` (drop what is queued).

A :class:`Dialect` is one carrier's names and shapes; nothing here holds state or a rule of the
conversation (``pipeline/adapters/phone/adapter.py`` does the translating). Anything malformed raises
:class:`StreamError`, which closes the stream with its reason.
"""
from __future__ import annotations

import base64
import binascii
from dataclasses import dataclass, field

from pipeline.adapters.audio_formats import PCMA, PCMU, AudioFormat

FRAME_BYTES = 160  # one 20 ms G.711 frame at 8 kHz: what carriers send, and what we send back
MAX_PAYLOAD_CHARS = 16 * 1024  # base64 of one media message (~1 s of G.711; carriers send 20 ms)


class StreamError(Exception):
    """A carrier message this stream cannot take: the stream closes (1008) with ``reason``."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


@dataclass(frozen=True)
class CallStart:
    stream_id: str
    call_id: str  # Twilio's callSid, Telnyx's call_control_id: what call control acts on
    audio: AudioFormat
    parameters: dict[str, str] = field(default_factory=dict)  # what the call's setup passed (<Parameter>)


def _str(value, what: str) -> str:
    if not isinstance(value, str) or not value:
        raise StreamError(f"{what} is missing or not a string")
    return value


def _parameters(params, what: str) -> dict[str, str]:
    """A start's custom parameters (what the call's setup passed): names are strings, values
    strings or numbers (read as text); anything else is refused, naming the field."""
    if not isinstance(params, dict):
        raise StreamError(f"{what} must be an object")
    out = {}
    for name, value in params.items():
        if isinstance(value, bool) or not isinstance(value, (str, int, float)):
            raise StreamError(f"{what}.{str(name)[:40]} must be a string, got {type(value).__name__}")
        out[name] = str(value)
    return out


def _object(msg: dict, name: str) -> dict:
    value = msg.get(name)
    if not isinstance(value, dict):
        raise StreamError(f"a {msg.get('event')} message needs {name} (an object)")
    return value


def payload(msg: dict) -> bytes:
    """A media message's audio bytes."""
    data = _object(msg, "media").get("payload")
    if not isinstance(data, str) or len(data) > MAX_PAYLOAD_CHARS:
        raise StreamError(f"media.payload must be base64 of at most {MAX_PAYLOAD_CHARS} characters")
    try:
        return base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise StreamError("media.payload is not valid base64") from None


def digit(msg: dict) -> str:
    value = _object(msg, "dtmf").get("digit")
    if not isinstance(value, str) or len(value) != 1 or value not in "0123456789*#ABCD":
        raise StreamError(f"dtmf.digit must be one of 0-9, *, #, A-D, got {value!r}")
    return value


def mark_name(msg: dict) -> str:
    return _str(_object(msg, "mark").get("name"), "mark.name")


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


class Twilio:
    """Twilio Media Streams, bidirectional (``<Connect><Stream>``): camelCase, μ-law only, and
    every message we send names the stream (``streamSid``)."""

    name = "twilio"

    @staticmethod
    def start(msg: dict) -> CallStart:
        start = _object(msg, "start")
        fmt = start.get("mediaFormat") or {}
        if not isinstance(fmt, dict) or (fmt.get("encoding"), fmt.get("sampleRate"), fmt.get("channels", 1)) \
                != ("audio/x-mulaw", 8000, 1):
            raise StreamError(f"only audio/x-mulaw at 8000 Hz, mono, is served; the stream offers {str(fmt)[:200]}")
        return CallStart(_str(start.get("streamSid") or msg.get("streamSid"), "start.streamSid"),
                         _str(start.get("callSid"), "start.callSid"), PCMU,
                         _parameters(start.get("customParameters") or {}, "start.customParameters"))

    @staticmethod
    def media(stream_id: str, data: bytes) -> dict:
        return {"event": "media", "streamSid": stream_id, "media": {"payload": _b64(data)}}

    @staticmethod
    def mark(stream_id: str, name: str) -> dict:
        return {"event": "mark", "streamSid": stream_id, "mark": {"name": name}}

    @staticmethod
    def clear(stream_id: str) -> dict:
        return {"event": "clear", "streamSid": stream_id}


class Telnyx:
    """Telnyx media streaming, bidirectional RTP mode: snake_case, PCMU or PCMA, and the
    stream is the connection (what we send names none)."""

    name = "telnyx"
    ENCODINGS = {"PCMU": PCMU, "PCMA": PCMA}

    @classmethod
    def start(cls, msg: dict) -> CallStart:
        start = _object(msg, "start")
        fmt = start.get("media_format") or {}
        encoding = fmt.get("encoding") if isinstance(fmt, dict) else None
        audio = cls.ENCODINGS.get(encoding) if isinstance(encoding, str) else None
        if audio is None or str(fmt.get("sample_rate", 8000)) != "8000" or str(fmt.get("channels", 1)) != "1":
            raise StreamError(f"only PCMU or PCMA at 8000 Hz, mono, is served; the stream offers {str(fmt)[:200]}")
        params = start.get("custom_parameters") or {}
        if isinstance(params, list):  # the call command's form: [{"name": ..., "value": ...}]
            if not all(isinstance(p, dict) and isinstance(p.get("name"), str) for p in params):
                raise StreamError("start.custom_parameters is a list of {name, value} with string names")
            params = {p["name"]: p.get("value") for p in params}
        return CallStart(_str(msg.get("stream_id") or start.get("stream_id"), "stream_id"),
                         _str(start.get("call_control_id"), "start.call_control_id"), audio,
                         _parameters(params, "start.custom_parameters"))

    @staticmethod
    def media(stream_id: str, data: bytes) -> dict:
        return {"event": "media", "media": {"payload": _b64(data)}}

    @staticmethod
    def mark(stream_id: str, name: str) -> dict:
        return {"event": "mark", "mark": {"name": name}}

    @staticmethod
    def clear(stream_id: str) -> dict:
        return {"event": "clear"}


Dialect = type[Twilio] | type[Telnyx]
DIALECTS: dict[str, Dialect] = {"twilio": Twilio, "telnyx": Telnyx}
