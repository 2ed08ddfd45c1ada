"""The gateway's door: every handshake is checked here before the WebSocket is accepted.

In order: the ``Host`` (one of this server's names, which defeats DNS rebinding), the ``Origin``,
the client's failed attempts, the credentials (``pipeline.door.auth``), then, counted only for
handshakes with good credentials, the client's handshake rate and concurrent sessions. Failed
attempts are counted apart, so an anonymous flood (from any number of addresses) never costs a
token holder anything. A refusal is an HTTP status with a stable code, sent
instead of the upgrade: nothing (no session, no recogniser slot) exists for it yet. An admitted
handshake holds one of its client's session places until ``release()``.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from pipeline.door.auth import TICKET_PARAM, AuthError, Authenticator, bearer, host_allowed, origin_allowed
from pipeline.door.client_limits import ClientLimits, LimitExceeded
from pipeline.resume.tokens import PARAMS as RESUME_PARAMS

# Refusal codes (docs/protocol.md, "Authentication and limits") and their HTTP statuses.
E_UNAUTHORIZED = "unauthorized"
E_ORIGIN_NOT_ALLOWED = "origin_not_allowed"
E_TOO_MANY_HANDSHAKES = "too_many_handshakes"
E_TOO_MANY_SESSIONS = "too_many_sessions"
E_HOST_NOT_ALLOWED = "host_not_allowed"
STATUS = {E_UNAUTHORIZED: 401, E_ORIGIN_NOT_ALLOWED: 403, E_HOST_NOT_ALLOWED: 403, E_TOO_MANY_HANDSHAKES: 429,
          E_TOO_MANY_SESSIONS: 429, "server_busy": 503}


class Refused(Exception):
    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code
        self.status = STATUS[code]

    def body(self) -> dict:
        return {"type": "error", "code": self.code, "message": str(self)}


@dataclass
class Handshake:
    """What the gateway knows of a connection attempt; header names lower-case."""

    headers: dict[str, str]
    query: dict[str, str]
    address: str

    @property
    def session_query(self) -> dict[str, str]:
        """The query without credentials and resume parameters: what is left are session options."""
        return {k: v for k, v in self.query.items() if k != TICKET_PARAM and k not in RESUME_PARAMS}


class Admission:
    """One admitted session's place in its client's count; ``release()`` once, when it ends."""

    def __init__(self, limits: ClientLimits, address: str):
        self._limits, self.address, self._held = limits, address, True

    def release(self) -> None:
        if self._held:
            self._held = False
            self._limits.close_session(self.address)


class WaitingStreams:
    """Carrier streams waiting for their start on this replica: at most ``limit`` in all, and at
    most a quarter of them (at least one) from one address."""

    def __init__(self, limit: int):
        self.limit, self.per_address = limit, max(1, limit // 4)
        self.by_address: Counter[str] = Counter()

    def __len__(self) -> int:
        return sum(self.by_address.values())

    def room_for(self, address: str) -> bool:
        return len(self) < self.limit and self.by_address[address] < self.per_address

    def push(self, address: str) -> None:
        self.by_address[address] += 1

    def pop(self, address: str) -> None:
        self.by_address[address] -= 1
        if self.by_address[address] <= 0:
            del self.by_address[address]


class StreamAdmission:
    """A carrier stream admitted to wait for its start (``pipeline/adapters/phone/adapter.py``
    ``serve_call``): it holds one of the replica's waiting places (and of its address's), and no
    session place, until ``verified()`` exchanges them for a session place (Refused when its
    address has none left). It was counted as a failed attempt of its address when admitted: a
    verified stream is forgiven it, one that never showed a good start (``refused()``) is not.
    ``release()`` once, when it ends, gives back whichever place it holds."""

    def __init__(self, gate: "Gatekeeper", hs: Handshake):
        self._gate, self._hs = gate, hs
        self._waiting = True
        self._session: Admission | None = None

    def verified(self) -> None:
        self._stop_waiting()
        self._gate.failures.forgive(self._hs.address)
        self._session = self._gate._open(self._hs)

    def release(self) -> None:
        self._stop_waiting()
        if self._session is not None:
            self._session.release()

    def _stop_waiting(self) -> None:
        if self._waiting:
            self._waiting = False
            self._gate.waiting.pop(self._hs.address)


class Gatekeeper:
    def __init__(self, auth: Authenticator, limits: ClientLimits, failures: ClientLimits | None = None,
                 max_waiting_streams: int = 16):
        self.auth = auth
        self.limits = limits  # handshakes with good credentials, and sessions, per address
        # handshakes refused for their credentials, per address (the same rate)
        self.failures = failures or ClientLimits(1, limits.per_minute, max_clients=limits.max_clients)
        self.max_waiting_streams = max_waiting_streams  # carrier streams yet to show their credential
        self.waiting = WaitingStreams(max_waiting_streams)

    def admit(self, hs: Handshake) -> Admission:
        """Admit a conversation handshake, or raise Refused."""
        self._check_host(hs)
        self._check_origin(hs)
        self._check_credentials(hs, lambda: self.auth.check(hs.headers, hs.query))
        return self._open(hs)

    def admit_stream(self, hs: Handshake) -> StreamAdmission:
        """Admit a carrier's media stream (a phone call) to wait for its start, or raise Refused:
        its credential comes inside the stream (a carrier's handshake carries no headers of ours,
        and no Origin), so here the host, the address's failed attempts and the replica's places
        for waiting streams are checked; its session place is taken once the credential is good
        (:class:`StreamAdmission`)."""
        self._check_host(hs)
        if not self.waiting.room_for(hs.address):
            raise Refused("server_busy", "too many call streams are waiting for their start here (from this address, "
                                         "or in all); try again shortly")
        try:
            self.failures.handshake(hs.address)  # a failure until its start is verified (then forgiven)
        except LimitExceeded as exc:
            raise Refused(exc.code, str(exc)) from None
        self.waiting.push(hs.address)
        return StreamAdmission(self, hs)

    def _count_failure(self, address: str) -> None:
        try:
            self.failures.handshake(address)
        except LimitExceeded:
            pass  # this failure is the one that reached the rate; the next attempt is refused

    def _open(self, hs: Handshake) -> Admission:
        """Count the handshake against the address's rate and take one of its session places."""
        self._count_handshake(hs.address)
        try:
            self.limits.open_session(hs.address)
        except LimitExceeded as exc:
            raise Refused(exc.code, str(exc)) from None
        return Admission(self.limits, hs.address)

    def check_ticket_request(self, hs: Handshake) -> None:
        """Raise Refused unless ``hs`` may have a ticket, or read what its token may (a call's
        record): the host, the origin, a bearer token."""
        self._check_host(hs)
        self._check_origin(hs)
        self._check_credentials(hs, lambda: self.auth.require_token(hs.headers))

    def issue_ticket(self, hs: Handshake) -> dict:
        """``POST /v1/session``: a single-use ticket for a browser's WebSocket handshake."""
        self.check_ticket_request(hs)
        self._count_handshake(hs.address)
        ticket, ttl = self.auth.issue(for_token=bearer(hs.headers))
        return {"ticket": ticket, "expires_in_s": ttl, "auth": self.auth.cfg.mode,
                "url": f"/v1/conversation?{TICKET_PARAM}={ticket}"}

    def check_metrics(self, headers: dict[str, str]) -> None:
        if self.auth.cfg.metrics_token:
            try:
                self.auth.require_token(headers)
            except AuthError as exc:
                raise Refused(E_UNAUTHORIZED, str(exc)) from None

    def check_host(self, headers: dict[str, str]) -> None:
        """Every route: the ``Host`` must be one of this server's names (auth.allowed_hosts, and
        loopback); a page on another name that resolves here (DNS rebinding) is refused."""
        if not host_allowed(headers.get("host"), self.auth.cfg.allowed_hosts):
            raise Refused(E_HOST_NOT_ALLOWED, f"host {headers.get('host')!r} is not one of this server's names "
                                              "(auth.allowed_hosts)")

    def _check_host(self, hs: Handshake) -> None:
        self.check_host(hs.headers)

    def _check_credentials(self, hs: Handshake, check) -> None:
        """Run ``check`` (raises AuthError); a refusal counts against the address's failed attempts,
        and an address past its rate of them is refused before its credentials are looked at."""
        try:
            self.failures.check_rate(hs.address)
        except LimitExceeded as exc:
            raise Refused(exc.code, str(exc)) from None
        try:
            check()
        except AuthError as exc:
            self._count_failure(hs.address)
            raise Refused(E_UNAUTHORIZED, str(exc)) from None

    def _check_origin(self, hs: Handshake) -> None:
        if not origin_allowed(hs.headers.get("origin"), hs.headers.get("host"), self.auth.cfg.allowed_origins):
            raise Refused(E_ORIGIN_NOT_ALLOWED, f"origin {hs.headers.get('origin')!r} may not connect here "
                                                "(auth.allowed_origins)")

    def _count_handshake(self, address: str) -> None:
        try:
            self.limits.handshake(address)
        except LimitExceeded as exc:
            raise Refused(exc.code, str(exc)) from None
