"""The Realtime protocol's session object, and what it means for the conversation core.

A Realtime client sees its session as one JSON object (``session.created`` / ``session.updated``)
and changes it with partial ``session.update`` events, merged deep into it. :func:`apply`
reads the merged object into the core's terms, checking every value first, so a bad update is
refused whole:

- ``audio.input.turn_detection``: ``null`` -> the client ends turns (``commit``), no VAD events,
  no barge-in; ``server_vad`` -> the VAD ends a turn after ``silence_duration_ms`` of silence;
  ``semantic_vad`` -> the VAD plus Smart Turn (our semantic end-of-turn model), with
  ``eagerness`` choosing how sure it must be and how long an unsure pause may last. Both VADs
  barge in on speech when ``interrupt_response`` is true and answer a turn when
  ``create_response`` is true. Our extension ``resume_false_interruption`` (the server's default
  unless given): speech over a reply pauses it, and it resumes if the speech was no turn.
- ``audio.input.format`` / ``audio.output.format``: ``audio/pcm`` (24 kHz), ``audio/pcmu``,
  ``audio/pcma`` (8 kHz).
- ``audio.input.noise_reduction``: ``{"type": "near_field"}`` -> RNNoise, ``far_field`` ->
  DeepFilterNet3 (``NOISE_TYPES``), ``null`` -> none: the session's noise suppressor, in front of
  its echo canceller and VAD (docs/realtime.md says what each is for and costs).
- ``instructions``, ``audio.output.voice``, ``output_modalities``, ``max_output_tokens``,
  ``tools``, ``tool_choice`` and our extension ``temperature``: the agent's settings.
The rest of OpenAI's session (model, tracing, truncation, prompt, ...) is kept and
echoed, and changes nothing here. Keys that are not part of a session are dropped (:func:`known`),
and the session object a client builds up is at most ``MAX_SESSION_CHARS`` of JSON.
"""
from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from typing import Any

from pipeline.conversation.agent import BadSetting, check_tools_depth, depth
from pipeline.adapters.audio_formats import FORMATS, AudioFormat
from pipeline.session_config import SessionConfig

# semantic_vad's eagerness -> (Smart Turn threshold, longest pause it may leave a turn open, ms)
EAGERNESS = {"low": (0.7, 3000.0), "medium": (0.5, 1500.0), "auto": (0.5, 1500.0), "high": (0.3, 800.0)}
# audio.input.noise_reduction's type -> SessionConfig.noise_reduction: a close microphone (a headset)
# gets RNNoise; a far one (a laptop, a room) DeepFilterNet3, which suppresses more and costs more.
NOISE_TYPES = {"near_field": "rnnoise", "far_field": "deepfilter"}
# Beta (OpenAI-Beta: realtime=v1) flat session fields -> their GA place
BETA_FORMATS = {"pcm16": {"type": "audio/pcm", "rate": 24000}, "g711_ulaw": {"type": "audio/pcmu"},
                "g711_alaw": {"type": "audio/pcma"}}


# The session object's size as JSON, tools included (a voice clip's audio is not kept in it), and
# how deeply the rest of it nests (tools: MAX_SCHEMA_DEPTH for their parameters).
MAX_SESSION_CHARS = 64 * 1024
MAX_SESSION_DEPTH = 16
# The keys a session object has (initial() holds them all), and those of its audio sides; any
# other key of a session.update is dropped, so an update costs what a session is, not what was sent.
SESSION_KEYS = frozenset({"type", "object", "id", "model", "output_modalities", "instructions", "audio", "tools",
                          "tool_choice", "max_output_tokens", "temperature", "tool_filler", "tool_filler_after_ms",
                          "tracing", "truncation", "prompt", "include", "expires_at"})
AUDIO_KEYS = {"input": frozenset({"format", "transcription", "noise_reduction", "turn_detection"}),
              "output": frozenset({"format", "voice", "speed", "voice_clip"})}


def known(update: dict) -> dict:
    """``update`` without the keys no session has (at the top, and in ``audio.input``/``output``);
    raises BadSetting where ``audio`` or one of its sides is not an object (or null)."""
    out = {k: v for k, v in update.items() if k in SESSION_KEYS}
    audio = out.get("audio")
    if "audio" in out and not isinstance(audio, dict):
        raise BadSetting("session.audio", f"session.audio must be an object, got {type(audio).__name__}")
    if isinstance(audio, dict):
        for side, value in audio.items():
            if side in AUDIO_KEYS and value is not None and not isinstance(value, dict):
                raise BadSetting(f"session.audio.{side}",
                                 f"session.audio.{side} must be an object, got {type(value).__name__}")
        out["audio"] = {side: ({k: v for k, v in value.items() if k in AUDIO_KEYS[side]}
                               if isinstance(value, dict) else value)
                        for side, value in audio.items() if side in AUDIO_KEYS}
    return out


def check_size(session: dict) -> None:
    """Raises BadSetting when the session object is over MAX_SESSION_CHARS of JSON."""
    size = len(json.dumps(session))
    if size > MAX_SESSION_CHARS:
        raise BadSetting("session", f"the session object would be {size} characters of JSON; at most "
                                    f"{MAX_SESSION_CHARS} (instructions, tools and the rest together)")


@dataclass(frozen=True)
class SessionTerms:
    """A session object read into the core's terms."""

    input_format: AudioFormat
    output_format: AudioFormat
    turn_taking: dict[str, Any]  # SessionConfig fields (the Configure command's turn_taking)
    agent: dict[str, Any]  # AgentSettings fields (the Configure command's agent)
    reply_on_turn_end: bool  # create_response
    transcription: bool  # send transcription events for user audio


def deep_merge(base: dict, update: dict) -> dict:
    """``base`` with ``update`` merged in: maps merge key by key, anything else replaces, and so
    does a map of another ``type`` (a new turn detection or audio format is taken whole: a
    server_vad's threshold is no semantic_vad setting, a 24 kHz rate no μ-law one)."""
    out = copy.deepcopy(base)
    for key, value in update.items():
        old = out.get(key)
        if isinstance(value, dict) and isinstance(old, dict) and value.get("type", old.get("type")) == old.get("type"):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def from_beta(update: dict) -> dict:
    """A beta ``session.update``'s flat fields in their GA places (GA fields pass through)."""
    out = {k: v for k, v in update.items() if k not in ("modalities", "voice", "input_audio_format",
                                                          "output_audio_format", "input_audio_transcription",
                                                          "turn_detection", "max_response_output_tokens",
                                                          "input_audio_noise_reduction")}
    audio: dict = {}
    if "modalities" in update:
        mods = update["modalities"]
        out["output_modalities"] = ["audio"] if isinstance(mods, list) and "audio" in mods else mods
    if "voice" in update:
        audio.setdefault("output", {})["voice"] = update["voice"]
    for key, side in (("input_audio_format", "input"), ("output_audio_format", "output")):
        if key in update:
            value = update[key]
            audio.setdefault(side, {})["format"] = BETA_FORMATS.get(value, value) if isinstance(value, str) else value
    if "input_audio_transcription" in update:
        audio.setdefault("input", {})["transcription"] = update["input_audio_transcription"]
    if "turn_detection" in update:
        audio.setdefault("input", {})["turn_detection"] = update["turn_detection"]
    if "input_audio_noise_reduction" in update:
        audio.setdefault("input", {})["noise_reduction"] = update["input_audio_noise_reduction"]
    if "max_response_output_tokens" in update:
        out["max_output_tokens"] = update["max_response_output_tokens"]
    if audio:
        base = out.get("audio") or {}
        if not isinstance(base, dict) or not all(isinstance(base.get(side) or {}, dict) for side in audio):
            raise BadSetting("session.audio", "session.audio and its input and output must be objects")
        out["audio"] = deep_merge(base, audio)
    return out


def initial(session_id: str, model: str, cfg: SessionConfig) -> dict:
    """The session a client starts with: the server's turn taking in the protocol's words."""
    if cfg.turn_detection == "manual":
        detection = None
    else:
        detection = {"type": "semantic_vad", "eagerness": "auto", "create_response": True,
                     "interrupt_response": cfg.barge_in != "off",
                     "resume_false_interruption": cfg.resume_false_interruption}
    return {
        "type": "realtime", "object": "realtime.session", "id": session_id, "model": model,
        "output_modalities": ["audio"], "instructions": "",
        "audio": {"input": {"format": {"type": "audio/pcm", "rate": 24000},
                            "transcription": {"model": "gapless-stt"},
                            "noise_reduction": _noise_object(cfg.noise_reduction),
                            "turn_detection": detection},
                  "output": {"format": {"type": "audio/pcm", "rate": 24000}, "voice": "default", "speed": 1.0}},
        "tools": [], "tool_choice": "auto", "max_output_tokens": "inf", "temperature": None,
        "tool_filler": None, "tool_filler_after_ms": 700,
        "tracing": None, "truncation": "auto", "prompt": None, "include": None, "expires_at": 0,
    }


def _format(session: dict, side: str) -> AudioFormat:
    fmt = ((session.get("audio") or {}).get(side) or {}).get("format")
    param = f"session.audio.{side}.format"
    if not isinstance(fmt, dict) or not isinstance(fmt.get("type"), str) or fmt["type"] not in FORMATS:
        raise BadSetting(param, f"{param} must be {{\"type\": \"audio/pcm\", \"rate\": 24000}}, "
                                f"{{\"type\": \"audio/pcmu\"}} or {{\"type\": \"audio/pcma\"}}, got {fmt!r}")
    found = FORMATS[fmt["type"]]
    if fmt.get("rate", found.rate) != found.rate:
        raise BadSetting(param, f"{fmt['type']} runs at {found.rate} Hz here, not {fmt.get('rate')!r}")
    return found


def _number(detection: dict, name: str, low: float, high: float, default: float) -> float:
    value = detection.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
        param = f"session.audio.input.turn_detection.{name}"
        raise BadSetting(param, f"{param} must be a number from {low:g} to {high:g}, got {value!r}")
    return float(value)


def _flag(detection: dict, name: str, default: bool = True) -> bool:
    value = detection.get(name, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        param = f"session.audio.input.turn_detection.{name}"
        raise BadSetting(param, f"{param} must be true or false, got {value!r}")
    return value


def _noise_object(kind: str | None) -> dict | None:
    """The server's own noise suppressor in the protocol's words (one it has no type for: near_field)."""
    if kind is None:
        return None
    return {"type": next((t for t, k in NOISE_TYPES.items() if k == kind), "near_field")}


def _noise_reduction(value: Any, server: SessionConfig) -> str | None:
    """``audio.input.noise_reduction`` -> SessionConfig.noise_reduction."""
    if value is None:
        return None
    kind = value.get("type") if isinstance(value, dict) else None
    if not isinstance(kind, str) or kind not in NOISE_TYPES:
        param = "session.audio.input.noise_reduction"
        raise BadSetting(param, f"{param} must be null or have type near_field or far_field, got {value!r}")
    if _noise_object(server.noise_reduction) == {"type": kind}:
        return server.noise_reduction  # the server's own, as its session says it
    return NOISE_TYPES[kind]


def _turn_taking(detection: Any, server: SessionConfig) -> tuple[dict[str, Any], bool]:
    """(SessionConfig changes, create_response) for a turn_detection object."""
    if detection is None:
        return {"turn_detection": "manual", "barge_in": "off", "vad_events": False}, False
    kind = detection.get("type") if isinstance(detection, dict) else None
    if kind not in ("server_vad", "semantic_vad"):
        param = "session.audio.input.turn_detection"
        raise BadSetting(param, f"{param} must be null or have type server_vad or semantic_vad, got {detection!r}")
    barge_in = server.barge_in if server.barge_in != "off" else "vad"
    changes: dict[str, Any] = {"turn_detection": "vad", "vad_events": True,
                               "barge_in": barge_in if _flag(detection, "interrupt_response") else "off",
                               "resume_false_interruption": _flag(detection, "resume_false_interruption",
                                                                  server.resume_false_interruption)}
    if kind == "server_vad":
        changes.update(vad_threshold=_number(detection, "threshold", 0.01, 0.99, server.vad_threshold),
                       vad_preroll_ms=_number(detection, "prefix_padding_ms", 0, 2000, server.vad_preroll_ms),
                       vad_min_silence_ms=_number(detection, "silence_duration_ms", 0, 10_000, 500),
                       eot_threshold=0.0)
        changes["eot_max_silence_ms"] = max(changes["vad_min_silence_ms"], server.eot_max_silence_ms)
    else:
        eagerness = detection.get("eagerness") or "auto"
        if not isinstance(eagerness, str) or eagerness not in EAGERNESS:
            param = "session.audio.input.turn_detection.eagerness"
            raise BadSetting(param, f"{param} must be one of {sorted(EAGERNESS)}, got {eagerness!r}")
        threshold, max_silence = EAGERNESS[eagerness]
        if eagerness == "auto":
            threshold, max_silence = server.eot_threshold or threshold, server.eot_max_silence_ms
        changes.update(vad_threshold=server.vad_threshold, vad_preroll_ms=server.vad_preroll_ms,
                       vad_min_silence_ms=server.vad_min_silence_ms, eot_threshold=threshold,
                       eot_max_silence_ms=max(max_silence, server.vad_min_silence_ms))
    return changes, _flag(detection, "create_response")


def read(update: Any, current: dict, server: SessionConfig, beta: bool = False) -> tuple[dict, SessionTerms, Any]:
    """A ``session.update``'s session (or the one a call is made with) over ``current``: the
    merged session object, its terms, and the voice clip it sends (None: none, unchecked), every
    value checked first by type and range; raises BadSetting naming the first bad one."""
    if not isinstance(update, dict):
        raise BadSetting("session", f"session must be an object, got {type(update).__name__}")
    check_tools_depth("tools", update.get("tools"))  # before anything copies them
    levels = depth({k: v for k, v in update.items() if k != "tools"})
    if levels > MAX_SESSION_DEPTH:
        raise BadSetting("session", f"the session object nests {levels} levels deep; at most {MAX_SESSION_DEPTH}")
    update = known(from_beta(update) if beta else update)
    clip = ((update.get("audio") or {}).get("output") or {}).pop("voice_clip", None)
    merged = deep_merge(current, update)
    check_size(merged)
    return merged, apply(merged, server), clip


def apply(session: dict, server: SessionConfig) -> SessionTerms:
    """Read a (merged) session object; raises BadSetting naming the first bad field."""
    if session.get("type", "realtime") != "realtime":
        raise BadSetting("session.type", "only realtime sessions are served here (not transcription sessions)")
    audio = session.get("audio")
    if not isinstance(audio, dict):
        raise BadSetting("session.audio", "session.audio must be an object")
    inp = audio.get("input") or {}
    out = audio.get("output") or {}
    turn_taking, reply_on_turn_end = _turn_taking(inp.get("turn_detection"), server)
    turn_taking["noise_reduction"] = _noise_reduction(inp.get("noise_reduction"), server)
    transcription = inp.get("transcription")
    if transcription is not None and not isinstance(transcription, dict):
        raise BadSetting("session.audio.input.transcription", "session.audio.input.transcription must be an object or null")
    voice = out.get("voice", "default")
    if isinstance(voice, dict):  # {"id": ...}: a custom voice, named by its id
        voice = voice.get("id")
    agent = {"instructions": session.get("instructions"), "voice": voice,
             "modalities": session.get("output_modalities") or ["audio"],
             "max_output_tokens": session.get("max_output_tokens"), "temperature": session.get("temperature"),
             "tools": session.get("tools") or [], "tool_choice": session.get("tool_choice") or "auto",
             "tool_filler": session.get("tool_filler"), "tool_filler_after_ms": session.get("tool_filler_after_ms", 700)}
    if transcription is not None:  # null turns transcription events off and leaves the language as it was
        agent["language"] = transcription.get("language")
    return SessionTerms(_format(session, "input"), _format(session, "output"), turn_taking, agent,
                        reply_on_turn_end, transcription is not None)


def response_overrides(params: dict) -> dict[str, Any]:
    """A ``response.create``'s ``response`` object -> AgentSettings overrides for that reply."""
    unsupported = [k for k in ("input", "prompt") if params.get(k)]
    if params.get("conversation", "auto") != "auto":
        unsupported.append("conversation")
    if unsupported:
        raise BadSetting(f"response.{unsupported[0]}", f"response.{unsupported[0]} is not supported here: a "
                                                      "response answers the conversation as it stands")
    out: dict[str, Any] = {}
    for key, field in (("instructions", "instructions"), ("output_modalities", "modalities"),
                       ("max_output_tokens", "max_output_tokens"), ("temperature", "temperature"),
                       ("tools", "tools"), ("tool_choice", "tool_choice")):
        if key in params:
            out[field] = params[key]
    voice = ((params.get("audio") or {}).get("output") or {}).get("voice")
    if voice is not None:
        out["voice"] = voice.get("id") if isinstance(voice, dict) else voice
    return out


def describe(session: dict, voice_clip: dict | None, beta: bool) -> dict:
    """The session object a client reads back (session.created / .updated): with what it says of
    the session's own voice clip, and for a beta client the flat fields beside the GA ones."""
    session = copy.deepcopy(session)
    if voice_clip is not None:
        session["audio"]["output"]["voice_clip"] = voice_clip
    if beta:
        audio = session["audio"]
        session.update(modalities=["text", "audio"] if session["output_modalities"] == ["audio"] else ["text"],
                       voice=audio["output"].get("voice"), turn_detection=audio["input"].get("turn_detection"),
                       input_audio_transcription=audio["input"].get("transcription"),
                       input_audio_noise_reduction=audio["input"].get("noise_reduction"),
                       input_audio_format=_beta_format(audio["input"]["format"]),
                       output_audio_format=_beta_format(audio["output"]["format"]))
    return session


def _beta_format(fmt: dict) -> str:
    return {"audio/pcm": "pcm16", "audio/pcmu": "g711_ulaw", "audio/pcma": "g711_alaw"}.get(fmt.get("type"), "pcm16")
