"""The ``phone:`` section of a serve config: who answers a call (named agents), how keys are
taken, and the carriers' accounts that the webhook and call control use (docs/phone.md).

Secrets never sit in the yaml: an account names the environment variables that hold them, read in
the gateway's process (:func:`carrier_secrets`). A carrier whose secrets are not set has no webhook
and no call control; its media streams are still served.
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any, Mapping

from pipeline.session_config import NOISE_REDUCTION
from pipeline.adapters.phone.call_control import CallControl, TelnyxCalls, TwilioCalls, tool_schemas

DTMF_MODES = ("turn", "tool")  # keys as a user turn, or as the result of the collect_digits tool
CALL_TOOLS = ("end_call", "transfer_call", "collect_digits")  # the built-in tools an agent may use
MAX_TRANSFER_TARGETS = 32


@dataclass(frozen=True)
class PhoneAgent:
    """Who answers a call: what the session's agent is set to when the call starts (unset: the
    server's defaults), the built-in call tools it may use, and where ``transfer_call`` may dial."""

    instructions: str | None = None
    voice: str | None = None
    tools: tuple[str, ...] = ()  # of CALL_TOOLS
    tool_choice: str | dict = "auto"
    transfer_to: tuple[str, ...] = ()  # numbers (E.164) or SIP URIs; transfer_call dials only these
    dtmf: str = "turn"
    speaks_first: bool = False  # the agent answers the call with a reply of its own (a greeting)
    # The call's noise suppressor (SessionConfig.noise_reduction; "none": none); unset: the server's.
    noise_reduction: str | None = None
    # Speech over a reply pauses it, and it resumes if the speech was no turn (a backchannel, a
    # noise): SessionConfig.resume_false_interruption; unset: the server's.
    resume_false_interruption: bool | None = None
    # The call's language (AgentSettings.language: what the recogniser hears, the voice must speak it);
    # unset: the server's. A call's "language" parameter may choose another.
    language: str | None = None

    def __post_init__(self) -> None:
        unknown = set(self.tools) - set(CALL_TOOLS)
        if unknown:
            raise ValueError(f"phone agent tools {sorted(unknown)} are unknown; the call tools are {list(CALL_TOOLS)}")
        if self.dtmf not in DTMF_MODES:
            raise ValueError(f"phone agent dtmf must be one of {DTMF_MODES}, got {self.dtmf!r}")
        if "transfer_call" in self.tools and not self.transfer_to:
            raise ValueError("a phone agent with transfer_call needs transfer_to: the numbers it may dial")
        if len(self.transfer_to) > MAX_TRANSFER_TARGETS or not all(isinstance(t, str) and t for t in self.transfer_to):
            raise ValueError(f"transfer_to is a list of at most {MAX_TRANSFER_TARGETS} numbers or SIP URIs")
        if self.noise_reduction not in (None, "none") + NOISE_REDUCTION:
            raise ValueError(f"phone agent noise_reduction must be one of {('none',) + NOISE_REDUCTION}, "
                             f"got {self.noise_reduction!r}")
        if not (self.resume_false_interruption is None or isinstance(self.resume_false_interruption, bool)):
            raise ValueError(f"phone agent resume_false_interruption must be true or false, "
                             f"got {self.resume_false_interruption!r}")
        if self.dtmf == "tool" and "collect_digits" not in self.tools:
            raise ValueError("dtmf: tool gives keys to the collect_digits tool: list it in the agent's tools")

    def turn_taking_changes(self) -> dict[str, Any]:
        """What it sets of the session's turn taking (SessionConfig fields)."""
        out: dict[str, Any] = {}
        if self.noise_reduction is not None:
            out["noise_reduction"] = None if self.noise_reduction == "none" else self.noise_reduction
        if self.resume_false_interruption is not None:
            out["resume_false_interruption"] = self.resume_false_interruption
        return out

    def agent_changes(self) -> dict[str, Any]:
        """What it sets of the session's agent (AgentSettings fields), its tools' schemas included."""
        out: dict[str, Any] = {}
        if self.instructions is not None:
            out["instructions"] = self.instructions
        if self.voice is not None:
            out["voice"] = self.voice
        if self.language is not None:
            out["language"] = self.language
        if self.tools:
            out["tools"] = tool_schemas(self.tools, self.transfer_to)
            out["tool_choice"] = self.tool_choice
        return out


@dataclass(frozen=True)
class CarrierAccount:
    """A carrier's REST account, by the environment variables that hold it. ``api_base_url``: the
    carrier's API (None: its public one; tests point it at a local fake)."""

    secret_env: str  # Twilio: the auth token (also what signs its webhooks); Telnyx: the API key
    account_env: str | None = None  # Twilio: the account SID
    api_base_url: str | None = None


@dataclass(frozen=True)
class PhoneConfig:
    agents: dict[str, PhoneAgent] = field(default_factory=dict)
    default_agent: str | None = None  # the agent of a call that names none (None: the server's defaults)
    # The public https URL carriers reach this server at (behind a proxy, what the carrier called):
    # Twilio's webhook signature covers it, and the stream URL the webhook returns is built on it.
    public_url: str | None = None
    twilio: CarrierAccount | None = None
    telnyx: CarrierAccount | None = None
    replay_window_s: float = 3600.0  # a webhook request is accepted once within this window
    hang_up_within_s: float = 10.0  # end_call/transfer_call wait this long at most for the reply to play
    # A media stream holds no session place until its start shows a good credential: until then it
    # waits, at most start_within_s, among at most unverified_streams such streams per gateway replica.
    start_within_s: float = 5.0  # carriers send start at once (Twilio: within its first messages)
    unverified_streams: int = 16

    def agent(self, name: str | None) -> PhoneAgent:
        """The named agent (None: the default one; raises KeyError for a name not configured)."""
        name = name or self.default_agent
        return PhoneAgent() if name is None else self.agents[name]


def read_phone_section(section: Mapping[str, Any] | None) -> PhoneConfig:
    """``phone:`` of a serve config -> PhoneConfig; an unknown name or a bad value raises ValueError."""
    section = dict(section or {})
    known = {f.name for f in dataclasses.fields(PhoneConfig)}
    unknown = set(section) - known
    if unknown:
        raise ValueError(f"unknown phone settings {sorted(unknown)}; known: {sorted(known)}")
    agents = {}
    for name, spec in (section.pop("agents", None) or {}).items():
        spec = dict(spec or {})
        names = {f.name for f in dataclasses.fields(PhoneAgent)}
        if set(spec) - names:
            raise ValueError(f"unknown settings {sorted(set(spec) - names)} of phone agent {name!r}; known: "
                             f"{sorted(names)}")
        agents[str(name)] = PhoneAgent(**{k: tuple(v) if k in ("tools", "transfer_to") else v
                                          for k, v in spec.items()})
    accounts = {}
    for carrier, secret, account in (("twilio", "TWILIO_AUTH_TOKEN", "TWILIO_ACCOUNT_SID"),
                                     ("telnyx", "TELNYX_API_KEY", None)):
        spec = section.pop(carrier, None)
        if spec is not None:
            spec = dict(spec)
            spec.setdefault("secret_env", secret)
            if account:
                spec.setdefault("account_env", account)
            accounts[carrier] = CarrierAccount(**spec)
    cfg = PhoneConfig(agents=agents, **accounts, **section)
    if cfg.default_agent is not None and cfg.default_agent not in agents:
        raise ValueError(f"phone default_agent {cfg.default_agent!r} is not one of the agents {sorted(agents)}")
    if cfg.public_url is not None and not cfg.public_url.startswith(("https://", "http://")):
        raise ValueError(f"phone public_url must be an http(s) URL, got {cfg.public_url!r}")
    if not (cfg.replay_window_s > 0 and cfg.hang_up_within_s > 0 and 0 < cfg.start_within_s <= 60):
        raise ValueError("phone replay_window_s and hang_up_within_s must be positive, start_within_s 0-60 s")
    if isinstance(cfg.unverified_streams, bool) or not isinstance(cfg.unverified_streams, int) \
            or cfg.unverified_streams < 1:
        raise ValueError(f"phone unverified_streams must be a positive integer, got {cfg.unverified_streams!r}")
    return cfg


def carrier_secrets(account: CarrierAccount | None, environ: Mapping[str, str] | None = None
                    ) -> tuple[str, str | None] | None:
    """The account's (secret, account id) from the environment; None when the secret is not set
    (that carrier then has no webhook and no call control)."""
    env = os.environ if environ is None else environ
    if account is None or not env.get(account.secret_env):
        return None
    return env[account.secret_env], (env.get(account.account_env) if account.account_env else None)


def carriers_calls(phone: PhoneConfig, environ: Mapping[str, str] | None = None) -> dict[str, CallControl]:
    """Each carrier's call control whose account is set in the environment."""
    out: dict[str, CallControl] = {}
    twilio = carrier_secrets(phone.twilio, environ)
    if twilio is not None and twilio[1]:
        out["twilio"] = TwilioCalls(twilio[1], twilio[0], phone.twilio.api_base_url)
    telnyx = carrier_secrets(phone.telnyx, environ)
    if telnyx is not None:
        out["telnyx"] = TelnyxCalls(telnyx[0], phone.telnyx.api_base_url)
    return out
