"""Protocol v1's session options: what a client may choose for its own session in the WebSocket
URL's query (docs/protocol.md, "Session options"), and the refusal of a bad one."""
from __future__ import annotations

import dataclasses

from pipeline import errors
from pipeline.connection import Connection
from pipeline.engines import ClientGone
from pipeline.session_config import SessionConfig
from pipeline.wire import WireSession


def session_options(cfg: SessionConfig, query: dict[str, str]) -> SessionConfig:
    """The server's session settings with what a client chose in the WebSocket URL's query
    (docs/protocol.md, "Session options"); a bad option raises ValueError."""
    unknown = set(query) - set(CLIENT_OPTIONS)
    if unknown:
        raise ValueError(f"unknown session options {sorted(unknown)}; known: {sorted(CLIENT_OPTIONS)}")
    chosen = {name: CLIENT_OPTIONS[name](name, value) for name, value in query.items()}
    return dataclasses.replace(cfg, **chosen) if chosen else cfg  # replace() validates the values


def _flag(name: str, value: str) -> bool:
    if value.lower() in ("true", "1"):
        return True
    if value.lower() in ("false", "0"):
        return False
    raise ValueError(f"session option {name} must be true or false, got {value!r}")


# What a client may choose for its own session, and how its query value is read.
CLIENT_OPTIONS = {
    "turn_detection": lambda name, value: value,  # "vad" | "manual", validated by SessionConfig
    "echo_cancellation": _flag,  # a client that cancels echo itself (a browser) may turn the server's off
    "barge_in": lambda name, value: value,  # "vad" | "words" | "vad+words" | "off", validated by SessionConfig
    "vad_events": _flag,  # speech.started / speech.stopped wanted or not
    "resume_false_interruption": _flag,  # a client that handles response.paused / response.resumed
    "preemptive_generation": _flag,
    # "webrtc" | "rnnoise" | "deepfilter" | "none", validated by SessionConfig (docs/turn-taking.md, "Noise")
    "noise_reduction": lambda name, value: None if value.lower() in ("none", "null", "off") else value,
}


async def refuse_options(conn: Connection, session_class: type[WireSession], message: str) -> None:
    """A handshake with bad session options: one error, close 1008, nothing set up for it."""
    try:
        await conn.send(session_class.error_frame(errors.E_BAD_OPTION, message))
        await conn.close(errors.CLOSE_POLICY_VIOLATION, "bad session option")
    except ClientGone:
        pass
