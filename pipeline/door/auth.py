"""Who may open a conversation: bearer tokens, single-use browser tickets, allowed origins,
and which network address a handshake counts against (the per-client limits).

Framework-free; the gateway calls it on every handshake before the WebSocket upgrade.

- **Tokens** come from an environment variable or a file (one per line), never from the
  config itself. They are compared in constant time and never logged. Each must be at least
  16 characters and not guessable from its own characters (``token_bits`` >= 64: one character
  repeated, or ``passwordpassword``, is refused at start-up, naming where it is, never the token).
  A tokens file other users may read or write is warned about.
- **Tickets**: a browser cannot set headers on a WebSocket handshake, so it first asks
  ``POST /v1/session`` with its token and connects with ``?ticket=...``. A ticket is
  ``<issued ms>.<expiry ms>.<nonce>.<HMAC-SHA256 of the three>``, good for one handshake and
  until its expiry, but never longer than ``ticket_ttl_s`` after it was issued, whatever expiry
  it carries (another server holding the same tokens may have minted it with a longer one).
  The HMAC key is derived from the token set, so every gateway replica that holds the same
  tokens verifies tickets any of them issued. Redeemed tickets are recorded in a
  ``RedeemedTickets`` store until they expire; the default, ``LocalRedeemed``, is this
  process's. The gateway also claims each ticket in the ledger all its replicas share
  (deployments/tickets.py), so a ticket opens one connection across replicas.
- **Origin**: a handshake that carries an ``Origin`` header (every browser's does) must come
  from the page's own origin or from one listed in ``allowed_origins``. Without this check any
  web site a user visits could open sessions on a server the user can reach.
- **Client address** (``client_address``): the peer's address; ``X-Forwarded-For`` is believed
  only from a peer listed in ``trusted_proxies`` (none by default). Ray Serve's HTTP proxy
  (uvicorn) already replaces the peer with an ``X-Forwarded-For`` address when the peer is
  loopback (its ``FORWARDED_ALLOW_IPS``, 127.0.0.1 and ::1 by default); that is undone here.
"""
from __future__ import annotations

import functools
import hashlib
import heapq
import hmac
import ipaddress
import logging
import math
import os
import secrets
import stat
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Protocol
from urllib.parse import urlsplit

log = logging.getLogger(__name__)

AUTH_MODES = ("token", "none")
TICKET_PARAM = "ticket"  # the WebSocket URL's query parameter that carries a ticket
MIN_TOKEN_CHARS = 16
MIN_TOKEN_BITS = 64.0  # estimated by token_bits
TICKET_CLOCK_SKEW_S = 5.0  # a ticket issued further in the future than this (another replica's clock) is refused
# What Ray Serve's HTTP proxy (uvicorn's ProxyHeadersMiddleware) takes X-Forwarded-For from,
# unless FORWARDED_ALLOW_IPS is set in its environment.
UVICORN_FORWARDED_ALLOW_IPS = "127.0.0.1,::1"
_LOOPBACK = (ipaddress.ip_network("127.0.0.0/8"), ipaddress.ip_network("::1/128"))


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
    ticket_ttl_s: float = 60.0  # a ticket's lifetime, and the longest any ticket is accepted for
    # Peers whose X-Forwarded-For names the client (addresses or CIDRs, e.g. a reverse proxy's);
    # none by default: a client is the address that connected.
    trusted_proxies: tuple[str, ...] = ()
    # The names this server answers to in the Host header, besides loopback (localhost,
    # 127.0.0.1, ::1): a page on any other name that resolves here (DNS rebinding) is refused.
    # "*" accepts any Host; "*.example.com" any subdomain of example.com.
    allowed_hosts: tuple[str, ...] = ()

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
        if isinstance(self.trusted_proxies, str):
            raise ValueError("auth.trusted_proxies must be a list of addresses or networks, not one string")
        proxies = []
        for entry in self.trusted_proxies:
            try:
                proxies.append(str(ipaddress.ip_network(str(entry).strip(), strict=False)))
            except ValueError:
                raise ValueError(f"auth.trusted_proxies: {entry!r} is not an address or network like "
                                 "10.0.0.5 or 10.0.0.0/8") from None
        object.__setattr__(self, "trusted_proxies", tuple(proxies))
        if isinstance(self.allowed_hosts, str):
            raise ValueError("auth.allowed_hosts must be a list of host names, not one string")
        object.__setattr__(self, "allowed_hosts", tuple(str(h).strip().lower() for h in self.allowed_hosts))
        for host in self.allowed_hosts:
            if not host or "/" in host or ":" in host.strip("[]").replace("::", "") and not _is_ipv6(host):
                raise ValueError(f"auth.allowed_hosts: {host!r} is not a host name (no scheme, port or path)")


LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1")


def _is_ipv6(value: str) -> bool:
    try:
        return ipaddress.ip_address(value.strip("[]")).version == 6
    except ValueError:
        return False


def _host_name(host_header: str) -> str | None:
    """The name of a ``Host`` header without its port, lower-case; None if it is malformed."""
    try:
        name = urlsplit(f"//{host_header.strip()}").hostname
    except ValueError:
        return None
    return name.lower() if name else None


def _is_loopback_ip(name: str) -> bool:
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def host_allowed(host_header: str | None, allowed: tuple[str, ...]) -> bool:
    """A request's ``Host`` is loopback or one of ``allowed`` (``*``: any, ``*.x``: x's subdomains).
    A request without one (HTTP/1.0) has nothing to rebind and passes."""
    if host_header is None:
        return True
    name = _host_name(host_header)
    if name is None:
        return False
    if "*" in allowed or name in LOOPBACK_HOSTS or name in allowed or _is_loopback_ip(name):
        return True
    return any(h.startswith("*.") and name.endswith(h[1:]) for h in allowed)


def _is_origin(value: str) -> bool:
    parts = urlsplit(value)
    return parts.scheme in ("http", "https") and bool(parts.netloc) and not parts.path


TOKEN_ID_CHARS = 16  # hex digits of a token's id
NONCE_CHARS = 22  # a ticket's random part (secrets.token_urlsafe(16))


def token_id(token: str) -> str:
    """A token's id: a one-way digest, never the token itself, safe to carry in tickets and tokens."""
    return hashlib.sha256(b"gapless principal\n" + token.encode()).hexdigest()[:TOKEN_ID_CHARS]


def token_bits(token: str) -> float:
    """A token's entropy as estimated from its own characters: its length times the Shannon
    entropy of their frequencies. One character repeated gives 0, ``abab...`` 1 bit a character;
    ``secrets.token_urlsafe(16)`` (128 random bits) gives 77 or more, ``token_hex(16)`` 92 or more.
    It is an upper bound on what a guesser needs, never a proof of randomness."""
    n = len(token)
    return -sum(c * math.log2(c / n) for c in Counter(token).values())


def load_tokens(cfg: AuthConfig, environ: dict[str, str] | None = None) -> tuple[str, ...]:
    """The tokens of ``mode: token``; ValueError (naming where it looked, never a token) when
    there are none, so a server that should be locked never starts open, and when one is short
    or guessable (naming which entry it is: ``$VAR entry N`` or ``file PATH line N``). A tokens
    file that other users may read or write is warned about."""
    if cfg.mode == "none":
        return ()
    environ = os.environ if environ is None else environ
    found: list[tuple[str, str]] = []  # (token, where)
    if cfg.tokens_env and environ.get(cfg.tokens_env):
        found += [(t, f"${cfg.tokens_env} entry {i}")
                  for i, t in enumerate(environ[cfg.tokens_env].replace(",", " ").split(), 1)]
    if cfg.tokens_file:
        path = Path(cfg.tokens_file).expanduser()
        try:
            with open(path) as f:
                mode = os.fstat(f.fileno()).st_mode
                lines = f.read().splitlines()
        except OSError as exc:
            raise ValueError(f"auth.tokens_file {str(path)!r} cannot be read: {exc.strerror}") from None
        if mode & 0o077:
            log.warning("auth.tokens_file %s may be read or written by other users (mode %03o); "
                        "run `chmod 600 %s`", path, stat.S_IMODE(mode), path)
        found += [(ln.strip(), f"file {path} line {i}") for i, ln in enumerate(lines, 1)
                  if ln.strip() and not ln.lstrip().startswith("#")]
    advice = "make one with `python -c 'import secrets; print(secrets.token_urlsafe(32))'`"
    short = [where for t, where in found if len(t) < MIN_TOKEN_CHARS]
    if short:
        raise ValueError(f"{len(short)} auth token(s) shorter than {MIN_TOKEN_CHARS} characters "
                         f"({', '.join(short)}); {advice}")
    weak = [where for t, where in found if token_bits(t) < MIN_TOKEN_BITS]
    if weak:
        raise ValueError(f"{len(weak)} auth token(s) too easy to guess, under {MIN_TOKEN_BITS:.0f} bits estimated "
                         f"from their characters (e.g. one character repeated) ({', '.join(weak)}); {advice}")
    if not found:
        where = " or ".join(filter(None, [cfg.tokens_env and f"${cfg.tokens_env}",
                                          cfg.tokens_file and f"file {cfg.tokens_file}"]))
        raise ValueError(f"auth.mode is token but no token was found in {where or 'nothing (set tokens_env or tokens_file)'}; "
                         "set one, or write `auth: {mode: none}` to serve without authentication")
    return tuple(dict.fromkeys(t for t, _ in found))


def bearer(headers: dict[str, str]) -> str | None:
    """The token of an ``Authorization: Bearer <token>`` header (header names lower-case)."""
    value = headers.get("authorization", "")
    scheme, _, token = value.partition(" ")
    if scheme.lower() != "bearer":
        return None
    return token.strip() or None


class RedeemedTickets(Protocol):
    """Where redeemed tickets are recorded. A store every gateway replica shares makes a ticket
    single-use across all of them; ``claim`` must then be atomic (e.g. Redis ``SET nonce 1 NX
    PXAT until``)."""

    def claim(self, nonce: str, until: float) -> bool:
        """Record ``nonce`` as redeemed until ``until`` (Unix seconds: when the ticket expires;
        the record may be forgotten after). True if it was not recorded yet, else False."""
        ...


class LocalRedeemed:
    """This process's record of redeemed tickets (the default store). Each record is forgotten
    when its ticket expires (at most ``ticket_ttl_s`` after it was issued), so it holds at most
    the tickets redeemed within one ticket lifetime."""

    def __init__(self, clock: Callable[[], float] = time.time):
        self.clock = clock
        self._until: dict[str, float] = {}
        self._expiries: list[tuple[float, str]] = []  # a heap of (until, nonce)

    def claim(self, nonce: str, until: float) -> bool:
        self._forget_expired(self.clock())
        if nonce in self._until:
            return False
        self._until[nonce] = until
        heapq.heappush(self._expiries, (until, nonce))
        return True

    def __len__(self) -> int:
        return len(self._until)

    def _forget_expired(self, now: float) -> None:
        while self._expiries and self._expiries[0][0] < now:
            _, nonce = heapq.heappop(self._expiries)
            del self._until[nonce]


@dataclass
class Authenticator:
    """Checks a handshake's credentials: a bearer token or a ticket (see the module docstring).
    ``redeemed``: where redeemed tickets are recorded (default: this process's ``LocalRedeemed``)."""

    cfg: AuthConfig
    tokens: tuple[str, ...]
    clock: Callable[[], float] = time.time
    redeemed: RedeemedTickets | None = None
    _key: bytes = field(init=False, repr=False)
    _proxies: tuple = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if self.cfg.mode == "token" and not self.tokens:
            raise ValueError("mode token needs at least one token")
        material = b"\n".join(sorted(t.encode() for t in self.tokens)) if self.tokens else secrets.token_bytes(32)
        self._key = hmac.new(b"gapless ticket key v1", material, hashlib.sha256).digest()
        if self.redeemed is None:
            self.redeemed = LocalRedeemed(self.clock)
        self._proxies = proxy_networks(self.cfg.trusted_proxies)

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

    def address_of(self, conn: Any) -> str:
        """The client address of a Starlette ``Request`` or ``WebSocket`` (anything with
        ``.client`` and ``.headers``) under this config's ``trusted_proxies``; see ``client_address``."""
        return client_address(getattr(conn, "client", None), conn.headers, self._proxies)

    # ---------------------------------------------------------------- tickets
    def issue(self, ttl_s: float | None = None, for_token: str | None = None) -> tuple[str, float]:
        """A fresh single-use ticket and its lifetime in seconds: ``ttl_s``, at most (and by
        default) ``ticket_ttl_s``. ``for_token``: the bearer token that asked for it, whose id
        the ticket carries (its nonce begins with it), so a session it opens has that principal."""
        ttl = self.cfg.ticket_ttl_s if ttl_s is None else min(float(ttl_s), self.cfg.ticket_ttl_s)
        if not ttl > 0:
            raise ValueError(f"a ticket's lifetime must be positive, got {ttl_s}")
        issued = int(self.clock() * 1000)
        nonce = (token_id(for_token) if for_token else "") + secrets.token_urlsafe(16)
        body = f"{issued}.{issued + int(ttl * 1000)}.{nonce}"
        return f"{body}.{self._sign(body)}", ttl

    def principal(self, headers: dict[str, str], query: dict[str, str]) -> str:
        """Who a handshake that passed :meth:`check` is, to bind its session's resume token to:
        its bearer token's id, or the id of the token that asked for its ticket; ``anyone`` with
        auth off."""
        if self.open:
            return "anyone"
        token = bearer(headers)
        if token is not None:
            return f"token:{token_id(token)}"
        nonce = query.get(TICKET_PARAM, "").split(".")[2:3]
        return f"token:{nonce[0][:TOKEN_ID_CHARS]}" if nonce and len(nonce[0]) > NONCE_CHARS else "ticket"

    def redeem(self, ticket: str) -> None:
        """Accept a ticket once: valid (``verify``) and never redeemed before (in ``self.redeemed``)."""
        nonce, ends = self.verify(ticket)
        if not self.redeemed.claim(nonce, ends):
            raise AuthError("the ticket was already used; each ticket opens one connection")

    def verify(self, ticket: str) -> tuple[str, float]:
        """A ticket's nonce and the time it stops being valid, or AuthError: it must be signed by
        this token set, issued no later than now (give or take ``TICKET_CLOCK_SKEW_S``),
        unexpired, and no older than ``ticket_ttl_s`` whatever expiry it carries. Whether it was
        used is not checked here (``redeem`` does; a caller with an asynchronous shared record
        can claim the nonce itself, until the returned time)."""
        parts = ticket.split(".")
        if len(parts) != 4:
            raise AuthError("the ticket is not valid")
        issued_text, expiry_text, nonce, signature = parts
        body = f"{issued_text}.{expiry_text}.{nonce}"
        digits = all(t.isascii() and t.isdigit() for t in (issued_text, expiry_text))
        if not (nonce and digits and hmac.compare_digest(signature.encode(), self._sign(body).encode())):
            raise AuthError("the ticket is not valid")
        issued, expiry = int(issued_text) / 1000, int(expiry_text) / 1000
        now = self.clock()
        if issued > now + TICKET_CLOCK_SKEW_S:
            raise AuthError("the ticket is not valid")
        ends = min(expiry, issued + self.cfg.ticket_ttl_s)
        if now > ends:
            raise AuthError("the ticket has expired; ask POST /v1/session for a new one")
        return nonce, ends

    def _sign(self, body: str) -> str:
        return hmac.new(self._key, body.encode(), hashlib.sha256).hexdigest()


# ------------------------------------------------------------------ client address
def proxy_networks(entries: Iterable[str]) -> tuple:
    """``trusted_proxies`` as networks. Loopback is one host: trusting any loopback address
    (127.0.0.0/8, ::1) trusts them all, since who can connect from one can from the others."""
    nets = [ipaddress.ip_network(e, strict=False) for e in entries]
    if any(_within(a, nets) for a in (ipaddress.ip_address("127.0.0.1"), ipaddress.ip_address("::1"))):
        nets += _LOOPBACK
    return tuple(nets)


def client_address(client: Any, headers: Mapping[str, str], trusted: Iterable = (),
                   upstream_allow: str | None = None) -> str:
    """Which client a connection counts as (the per-client limits' key): the address that
    connected, unless that peer is in ``trusted`` (networks, see ``proxy_networks``) and the
    request carries ``X-Forwarded-For``; then the right-most address in it that is not itself a
    trusted proxy (every hop trusted: the left-most).

    ``client`` is the ASGI ``(host, port)`` as the gateway sees it. Ray Serve's HTTP proxy runs
    uvicorn, which has already put an ``X-Forwarded-For`` address there when the real peer was one
    it trusts (``upstream_allow``: its ``FORWARDED_ALLOW_IPS``, by default this process's
    environment's, else 127.0.0.1 and ::1). Such a rewrite is recognised (the client is exactly
    what uvicorn picks from the header, with port 0 where the header gives none) and undone: the
    peer is then that trusted host (named by the first entry of ``upstream_allow``)."""
    # Over 40 lines as one function: one walk of the forwarded headers, right to left.
    if client is None:
        return "unknown"
    host, port = client[0], client[1]
    trusted = tuple(trusted)
    forwarded = _forwarded_for(headers)
    if not forwarded:
        return host
    upstream = os.environ.get("FORWARDED_ALLOW_IPS", UVICORN_FORWARDED_ALLOW_IPS) if upstream_allow is None else upstream_allow
    upstream_entries = [e.strip() for e in upstream.split(",") if e.strip()]
    if (host, port) == _uvicorn_pick(forwarded, upstream):
        # The real peer was one of uvicorn's trusted hosts; which one is not known.
        if "*" in upstream_entries:
            return "unknown"  # uvicorn believes every peer: the real one is lost
        peer = upstream_entries[0] if upstream_entries else "unknown"
        peer_nets = [_network(e) for e in upstream_entries]
    else:
        peer = host
        peer_nets = [_network(host)]
    if not trusted or not all(n is not None and _covered(n, trusted) for n in peer_nets):
        return peer
    last = peer
    for entry in reversed(forwarded):
        ip = _ip(_split_host_port(entry)[0])
        if ip is None:
            return last  # not an address: nothing left of it can be believed
        if not _within(ip, trusted):
            return str(ip)
        last = str(ip)
    return last


def _forwarded_for(headers: Any) -> list[str]:
    """Every ``X-Forwarded-For`` entry, in order (several headers read as one list, as uvicorn does)."""
    if hasattr(headers, "getlist"):
        values = headers.getlist("x-forwarded-for")
    else:
        value = headers.get("x-forwarded-for")
        values = [value] if value is not None else []
    return [e.strip() for e in ", ".join(values).split(",")] if values else []


def _uvicorn_pick(forwarded: list[str], allow: str) -> tuple[str, int] | None:
    """The ``(host, port)`` uvicorn's ProxyHeadersMiddleware sets from this header when it trusts
    the peer (None: it would set nothing). Uvicorn's own code where it is installed."""
    rule = _uvicorn_rule(allow)
    host, port = rule(", ".join(forwarded)) if rule is not None else _pick_like_uvicorn(forwarded, allow)
    return (host, port) if host else None


@functools.lru_cache(maxsize=8)
def _uvicorn_rule(allow: str) -> Callable[[str], tuple[str, int]] | None:
    """Uvicorn's own rule (its private ``_TrustedHosts``), where it is installed as we know it."""
    try:
        from uvicorn.middleware.proxy_headers import _TrustedHosts
        return _TrustedHosts(allow).get_trusted_client_address
    except (ImportError, AttributeError, TypeError):
        return None


def _pick_like_uvicorn(forwarded: list[str], allow: str) -> tuple[str, int]:
    """uvicorn 0.30+'s rule: the right-most entry not in ``allow``, else the left-most."""
    entries = [e.strip() for e in allow.split(",")]
    if "*" in entries:
        return _split_host_port(forwarded[0])
    nets = [n for n in map(_network, entries) if n is not None]
    for entry in reversed(forwarded):
        host, port = _split_host_port(entry)
        ip = _ip(host)
        if not (host in entries or (ip is not None and _within(ip, nets))):
            return host, port
    return _split_host_port(forwarded[0])


def _split_host_port(value: str) -> tuple[str, int]:
    """``1.2.3.4``, ``1.2.3.4:5678``, ``[::1]:5678`` or ``::1`` -> (host, port or 0)."""
    if value.startswith("["):
        end = value.find("]")
        if end == -1:
            return value, 0
        rest = value[end + 1:]
        if not rest:
            return value[1:end], 0
        if not rest.startswith(":"):
            return value, 0
        try:
            return value[1:end], int(rest[1:])
        except ValueError:
            return value[1:end], 0
    if value.count(":") == 1:
        host, port = value.rsplit(":", 1)
        try:
            return host, int(port)
        except ValueError:
            return value, 0
    return value, 0


def _ip(text: str):
    try:
        ip = ipaddress.ip_address(text)
    except ValueError:
        return None
    mapped = getattr(ip, "ipv4_mapped", None)
    return mapped or ip


def _network(text: str):
    try:
        net = ipaddress.ip_network(text, strict=False)
    except ValueError:
        return None
    mapped = getattr(net.network_address, "ipv4_mapped", None)
    return ipaddress.ip_network(mapped) if mapped is not None and net.prefixlen == 128 else net


def _within(ip, nets: Iterable) -> bool:
    return any(ip.version == n.version and ip in n for n in nets)


def _covered(net, nets: Iterable) -> bool:
    return any(net.version == n.version and net.subnet_of(n) for n in nets)


def origin_allowed(origin: str | None, host: str | None, allowed: tuple[str, ...]) -> bool:
    """A handshake without ``Origin`` (not from a browser) is not a cross-site request. With one,
    it must be the page's own origin (its host equals the request's ``Host``) or be listed."""
    if origin is None:
        return True
    origin = origin.rstrip("/")
    if "*" in allowed or origin in allowed:
        return True
    try:
        parts = urlsplit(origin)
        parts.port  # noqa: B018 - a malformed port raises here
    except ValueError:  # e.g. "http://[": not an origin at all
        return False
    return parts.scheme in ("http", "https") and host is not None and parts.netloc.lower() == host.lower()
