"""The application builder that ``serve_config.yaml`` imports: validated args -> four deployments."""
from __future__ import annotations

import dataclasses
import logging
import os
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict
from ray.serve import Application

from deployments.gateway import Gateway
from deployments.session_store import SessionStore
from deployments.llm import LLM
from deployments.stt import STICKY_ROUTER, STT
from deployments.tickets import TicketLedger
from deployments.tts import TTS
from pipeline import metrics
from pipeline.conversation.agent import AgentSettings, BadSetting
from pipeline.conversation.voice_offer import VoiceOffer
from pipeline.door.auth import AuthConfig, load_tokens
from pipeline.llm.config import LLMConfig
from pipeline.adapters.phone.config import read_phone_section
from pipeline.adapters.webrtc.config import read_webrtc_section
from pipeline.session_config import read_session_section
from pipeline.stt.config import STTConfig
from pipeline.tts.config import TTSConfig
from pipeline.tts.families import TTSFamilies

log = logging.getLogger(__name__)
PROFILES = ("tiny", "full", "real")


class AppArgs(BaseModel):
    """``args:`` of the app in serve_config.yaml. Unknown keys are errors, not ignored."""

    model_config = ConfigDict(extra="forbid")
    # tiny: small random-weight models (CPU); full: random weights at the real models' shapes
    # (GPU timing with no checkpoint, load/gpu_check.sh); real: the checkpoints.
    # Every engine config has the same profile field and tiny()/full()/real() constructors; an
    # engine's own settings may name another (llm: {profile: tiny}).
    profile: Literal["tiny", "full", "real"] = "tiny"
    device: Literal["cpu", "cuda"] = "cpu"
    stt: dict[str, Any] = {}
    llm: dict[str, Any] = {}
    # One TTS's settings, or a list of two of different families served at once (pipeline/tts/families.py)
    tts: dict[str, Any] | list[dict[str, Any]] = {}
    session: dict[str, Any] = {}
    # Who may connect (pipeline/door/auth.py, docs/protocol.md "Authentication and limits"). Unset,
    # auth is on (mode token) and the server does not start without a token: serving open
    # takes `auth: {mode: none}` written in the config.
    auth: dict[str, Any] = {}
    # Phone calls (docs/phone.md): named agents, DTMF, and the carriers' accounts by environment name.
    phone: dict[str, Any] = {}
    # WebRTC calls (docs/webrtc.md): the ICE servers (STUN/TURN) a peer connection uses.
    webrtc: dict[str, Any] = {}


def _engine_config(cls, profile: str, device: str, overrides: dict[str, Any]):
    """``cls.tiny()``, ``cls.full()`` or ``cls.real()`` for the app's profile (or the engine's own
    ``profile:`` setting, e.g. ``llm: {profile: tiny}``), then the yaml's device and settings."""
    overrides = dict(overrides)
    profile = overrides.pop("profile", profile)
    if profile not in PROFILES:
        raise ValueError(f"{cls.__name__} profile must be one of {PROFILES}, got {profile!r}")
    base = {"tiny": cls.tiny, "full": cls.full, "real": cls.real}[profile]()
    fields = {f.name for f in dataclasses.fields(cls)}
    unknown = set(overrides) - fields
    if unknown:
        raise ValueError(f"unknown {cls.__name__} settings {sorted(unknown)}; known: {sorted(fields)}")
    return dataclasses.replace(base, device=device, **overrides)


def _llm_settings(llm: dict[str, Any]) -> dict[str, Any]:
    """Backward-compatible alias: before every engine had a profile, a config chose the tiny LLM
    with ``llm: {model: tiny}``. A user's yaml that says so still starts (as ``llm: {profile:
    tiny}``, with a warning) instead of failing to find a checkpoint named "tiny"."""
    if llm.get("model") != "tiny":
        return llm
    log.warning("serve config: llm: {model: tiny} is deprecated; write llm: {profile: tiny}")
    return {**{k: v for k, v in llm.items() if k != "model"}, "profile": "tiny"}


def configs(args: AppArgs) -> dict[str, Any]:
    """Every setting checked before anything starts: engines, then session, then auth (last, so a
    typo elsewhere is reported as itself, not as a missing token)."""
    entries = args.tts if isinstance(args.tts, list) else [args.tts]
    if not 1 <= len(entries) <= 2:
        raise ValueError(f"tts: one engine's settings, or a list of two (one per family); got {len(entries)} entries")
    families = TTSFamilies(*(_engine_config(TTSConfig, args.profile, args.device, e) for e in entries))
    engines = {"stt": _engine_config(STTConfig, args.profile, args.device, args.stt),
               "llm": _engine_config(LLMConfig, args.profile, args.device, _llm_settings(args.llm)),
               "tts": families.first, "tts_second": families.second}
    read_session_section(args.session)  # unknown names and bad values (a limit of 0) stop `serve run` here
    check_phone_agents(read_phone_section(args.phone), families.voice_names(), offer_of(engines))
    read_webrtc_section(args.webrtc)
    auth_fields = {f.name for f in dataclasses.fields(AuthConfig)}
    unknown = set(args.auth) - auth_fields
    if unknown:
        raise ValueError(f"unknown auth settings {sorted(unknown)}; known: {sorted(auth_fields)}")
    load_tokens(AuthConfig(**args.auth))  # mode token without a token stops `serve run` here
    return {**engines, "session": dict(args.session), "auth": dict(args.auth), "phone": dict(args.phone),
            "webrtc": dict(args.webrtc)}


def families_of(engines: dict[str, Any]) -> TTSFamilies:
    return TTSFamilies(engines["tts"], engines.get("tts_second"))


def offer_of(engines: dict[str, Any]) -> VoiceOffer:
    """What sessions may choose: the languages the recogniser hears and each voice speaks, and which
    voices take a voice clip (CSM's)."""
    families = families_of(engines)
    return VoiceOffer(engines["stt"].heard(), families.voice_languages(), families.word_voices())


def check_phone_agents(phone, voices: tuple[str, ...], offer: VoiceOffer) -> None:
    """Each phone agent's settings as a call would set them (its voice named, its language heard and
    spoken by that voice): a bad one stops `serve run` here, not at its first call."""
    for name, agent in phone.agents.items():
        try:
            AgentSettings().updated(agent.agent_changes(), voices, offer)
        except BadSetting as exc:
            raise ValueError(f"phone agent {name!r}: {exc.param}: {exc.message}") from None


def build_app(args: dict[str, Any]) -> Application:
    cfg = configs(AppArgs(**(args or {})))
    if os.environ.get(metrics.MULTIPROC_ENV):
        metrics.prepare_multiproc_dir(os.environ[metrics.MULTIPROC_ENV])
    window = read_session_section(cfg["session"])[1].resume_window_s
    families = families_of(cfg)
    tts = [_tts_deployment(c, c is families.first) for c in families.configs]
    words = next((t for c, t in zip(families.configs, tts) if c is families.words()), None)
    clauses = next((t for c, t in zip(families.configs, tts) if c is not families.words()), tts[0])
    return Gateway.bind(STT.bind(cfg["stt"]), LLM.bind(cfg["llm"]), clauses, cfg["session"], cfg["auth"],
                        families.voice_names(), TicketLedger.bind(), SessionStore.bind(window_s=window),
                        cfg["phone"], cfg["webrtc"], offer_of(cfg), words)


def _tts_deployment(cfg: TTSConfig, first: bool):
    """One family's TTS deployment; the family that takes words (DSM) holds each reply's utterance in
    the replica that opened it, so its calls are routed by utterance id."""
    name = TTSFamilies.deployment_name(cfg, first)
    options = {"name": name} if not first else {}
    if cfg.family == "dsm":
        options["request_router_config"] = STICKY_ROUTER
    return TTS.options(**options).bind(cfg, name.lower())
