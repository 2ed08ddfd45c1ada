"""Who may open a conversation: bearer tokens, single-use browser tickets, allowed origins.

Framework-free; the gateway calls it on every handshake before the WebSocket upgrade.

- **Tokens** come from an environment variable or a file (one per line), never from the
  config itself. They are compared in constant time and never logged.
- **Tickets**: a browser cannot set headers on a WebSocket handshake, so it first asks
  ``POST /v1/session`` with its token and connects with ``?ticket=...``. A ticket is
  ``<expiry>.<nonce>.<HMAC-SHA256 of both>``, good for ``ticket_ttl_s`` and for one handshake.
  The HMAC key is derived from the token set, so every gateway replica that holds the same
  tokens verifies tickets any of them issued. The record of redeemed tickets is per replica.
- **Origin**: a handshake that carries an ``Origin`` header (every browser's does) must come
  from the page's own origin or from one listed in ``allowed_origins``. Without this check any
  web site a user visits could open sessions on a server the user can reach.
"""
from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable
from urllib.parse import urlsplit

AUTH_MODES = ("token", "none")
TICKET_PARAM = "ticket"  # the WebSocket URL's query parameter that carries a ticket


class AuthError(Exception):
    """Credentials missing or wrong; ``str()`` is safe to show the client (no secret in it)."""


@dataclass(frozen=True)
class AuthConfig:
    """``args.auth`` of serve_config*.yaml. ``mode: token`` (the default) needs at least one token
    from ``tokens_env`` or ``tokens_file``; ``mode: none`` must be written to run without."""

    mode: str = "token"
    tokens_env: str | None = "GAPLESS_TOKENS"  # comma- or whitespace-separated tokens
    tokens_file: str | None = None  # one token per line; blank lines and '#' comments skipped
    allowed_origins: tuple[str, ...] = ()  # besides the page's own origin; "*" allows any
    metrics_token: bool = True  # GET /metrics needs a bearer token too (in mode token)
    ticket_ttl_s: float = 60.0

    def __post_init__(self) -> None:
        if self.mode not in AUTH_MODES:
            raise ValueError(f"auth.mode must be one of {AUTH_MODES}, got {self.mode!r}")
        if not 1 <= self.ticket_ttl_s <= 3600:
            raise ValueError(f"auth.ticket_ttl_s must be within 1..3600 s, got {self.ticket_ttl_s}")
        if isinstance(self.allowed_origins, str):
            raise ValueError("auth.allowed_origins must be a list of origins, not one string")
        object.__setattr__(self, "allowed_origins", tuple(o.rstrip("/") for o in self.allowed_origins))
        for origin in self.allowed_origins:
            if origin != "*" and not _is_origin(origin):
                raise ValueError(f"auth.allowed_origins: {origin!r} is not an origin like https://example.com")


def _is_origin(value: str) -> bool:
    parts = urlsplit(value)
    return parts.scheme in ("http", "https") and bool(parts.netloc) and not parts.path


def load_tokens(cfg: AuthConfig, environ: dict[str, str] | None = None) -> tuple[str, ...]:
    """The tokens of ``mode: token``; ValueError (naming where it looked, never a token) when
    there are none, so a server that should be locked never starts open."""
    if cfg.mode == "none":
        return ()
    environ = os.environ if environ is None else environ
    tokens: list[str] = []
    if cfg.tokens_env and environ.get(cfg.tokens_env):
        tokens += environ[cfg.tokens_env].replace(",", " ").split()
    if cfg.tokens_file:
        path = Path(cfg.tokens_file).expanduser()
        try:
            lines = path.read_text().splitlines()
        except OSError as exc:
            raise ValueError(f"auth.tokens_file {str(path)!r} cannot be read: {exc.strerror}") from None
        tokens += [ln.strip() for ln in lines if ln.strip() and not ln.lstrip().startswith("#")]
    short = [t for t in tokens if len(t) < 16]
    if short:
        raise ValueError(f"{len(short)} auth token(s) shorter than 16 characters; use e.g. "
                         "`python -c 'import secrets; print(secrets.token_urlsafe(32))'`")
    if not tokens:
        where = " or ".join(filter(None, [cfg.tokens_env and f"${cfg.tokens_env}",
                                          cfg.tokens_file and f"file {cfg.tokens_file}"]))
        raise ValueError(f"auth.mode is token but no token was found in {where or 'nothing (set tokens_env or tokens_file)'}; "
                         "set one, or write `auth: {mode: none}` to serve without authentication")
    return tuple(dict.fromkeys(tokens))


def bearer(headers: dict[str, str]) -> str | None:
    """The token of an ``Authorization: Bearer <token>`` header (header names lower-case)."""
    value = headers.get("authorization", "")
    scheme, _, token = value.partition(" ")
    if scheme.lower() != "bearer":
        return None
    return token.strip() or None


@dataclass
class Authenticator:
    """Checks a handshake's credentials: a bearer token or a ticket (see the module docstring)."""

    cfg: AuthConfig
    tokens: tuple[str, ...]
    clock: Callable[[], float] = time.time
    _key: bytes = field(init=False, repr=False)
    _redeemed: dict[str, float] = field(init=False, default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if self.cfg.mode == "token" and not self.tokens:
            raise ValueError("mode token needs at least one token")
        material = b"\n".join(sorted(t.encode() for t in self.tokens)) if self.tokens else secrets.token_bytes(32)
        self._key = hmac.new(b"gapless ticket key v1", material, hashlib.sha256).digest()

    @property
    def open(self) -> bool:
        return self.cfg.mode == "none"

    def token_ok(self, token: str | None) -> bool:
        """Constant time in the token's content: every configured token is compared."""
        if token is None:
            return False
        given = token.encode()
        matches = [hmac.compare_digest(given, t.encode()) for t in self.tokens]
        return any(matches)

    def check(self, headers: dict[str, str], query: dict[str, str]) -> None:
        """Raise AuthError unless the handshake may open a session (always may in mode none)."""
        if self.open:
            return
        token = bearer(headers)
        if token is not None:
            if not self.token_ok(token):
                raise AuthError("the bearer token is not valid")
            return
        ticket = query.get(TICKET_PARAM)
        if ticket is None:
            raise AuthError("authentication required: send Authorization: Bearer <token>, "
                            "or connect with ?ticket= from POST /v1/session")
        self.redeem(ticket)

    def require_token(self, headers: dict[str, str]) -> None:
        """For plain HTTP routes (POST /v1/session, /metrics): a bearer token, no ticket."""
        if not self.open and not self.token_ok(bearer(headers)):
            raise AuthError("a valid Authorization: Bearer <token> header is required")

    # ---------------------------------------------------------------- tickets
    def issue(self) -> tuple[str, float]:
        """A fresh single-use ticket and its lifetime in seconds."""
        expiry = int(self.clock() + self.cfg.ticket_ttl_s)
        body = f"{expiry}.{secrets.token_urlsafe(16)}"
        return f"{body}.{self._sign(body)}", self.cfg.ticket_ttl_s

    def redeem(self, ticket: str) -> None:
        """Accept a ticket once: signed by this token set, unexpired, never redeemed before."""
        body, _, signature = ticket.rpartition(".")
        expiry_text, _, nonce = body.partition(".")
        if not (nonce and expiry_text.isdigit() and hmac.compare_digest(signature.encode(), self._sign(body).encode())):
            raise AuthError("the ticket is not valid")
        now = self.clock()
        if int(expiry_text) < now:
            raise AuthError("the ticket has expired; ask POST /v1/session for a new one")
        self._forget_expired(now)
        if nonce in self._redeemed:
            raise AuthError("the ticket was already used; each ticket opens one connection")
        self._redeemed[nonce] = float(expiry_text)

    def _sign(self, body: str) -> str:
        return hmac.new(self._key, body.encode(), hashlib.sha256).hexdigest()

    def _forget_expired(self, now: float) -> None:
        """A redeemed ticket need only be remembered until it expires: the record holds at most
        the tickets redeemed within one ticket lifetime (handshakes are rate-limited per client)."""
        for nonce in [n for n, exp in self._redeemed.items() if exp < now]:
            del self._redeemed[nonce]


def origin_allowed(origin: str | None, host: str | None, allowed: tuple[str, ...]) -> bool:
    """A handshake without ``Origin`` (not from a browser) is not a cross-site request. With one,
    it must be the page's own origin (its host equals the request's ``Host``) or be listed."""
    if origin is None:
        return True
    origin = origin.rstrip("/")
    if "*" in allowed or origin in allowed:
        return True
    parts = urlsplit(origin)
    return parts.scheme in ("http", "https") and host is not None and parts.netloc.lower() == host.lower()
