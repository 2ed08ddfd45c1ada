"""Per-client limits on a gateway replica: concurrent sessions and handshakes per minute.

A client is its network address as the gateway sees it. Both limits are checked before a
WebSocket is accepted, so a client over them costs nothing but the refusal, and one client's
limits never touch another's. Memory is bounded: an address is remembered only while it holds
sessions or has handshakes inside the last minute, and at most ``max_clients`` addresses at once.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

WINDOW_S = 60.0


class LimitExceeded(Exception):
    """``code`` is stable (a protocol error code); ``str()`` is for humans."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code


@dataclass
class _Client:
    sessions: int = 0
    handshakes: deque = field(default_factory=deque)  # monotonic times, within the last WINDOW_S


class ClientLimits:
    def __init__(self, max_sessions_per_client: int, handshakes_per_minute: int, max_clients: int = 10_000,
                 clock: Callable[[], float] = time.monotonic):
        if max_sessions_per_client < 1 or handshakes_per_minute < 1:
            raise ValueError("max_sessions_per_client and handshakes_per_minute must be at least 1")
        self.max_sessions = max_sessions_per_client
        self.per_minute = handshakes_per_minute
        self.max_clients = max_clients
        self.clock = clock
        self._clients: dict[str, _Client] = {}

    def handshake(self, address: str) -> None:
        """Count one handshake (or ticket request) of ``address``; LimitExceeded over the rate."""
        now = self.clock()
        client = self._client(address, now)
        while client.handshakes and client.handshakes[0] <= now - WINDOW_S:
            client.handshakes.popleft()
        if len(client.handshakes) >= self.per_minute:
            wait = client.handshakes[0] + WINDOW_S - now
            raise LimitExceeded("too_many_handshakes",
                                f"more than {self.per_minute} connection attempts a minute from this address; "
                                f"try again in {wait:.0f} s")
        client.handshakes.append(now)

    def open_session(self, address: str) -> None:
        """Take one of ``address``'s session places; LimitExceeded when it holds them all."""
        client = self._client(address, self.clock())
        if client.sessions >= self.max_sessions:
            raise LimitExceeded("too_many_sessions",
                                f"this address already holds {self.max_sessions} sessions, its maximum; "
                                "close one first")
        client.sessions += 1

    def close_session(self, address: str) -> None:
        client = self._clients.get(address)
        if client is not None and client.sessions > 0:
            client.sessions -= 1

    def sessions(self, address: str) -> int:
        client = self._clients.get(address)
        return client.sessions if client else 0

    def __len__(self) -> int:
        return len(self._clients)

    def _client(self, address: str, now: float) -> _Client:
        client = self._clients.get(address)
        if client is None:
            if len(self._clients) >= self.max_clients:
                self._forget_idle(now)
            if len(self._clients) >= self.max_clients:
                raise LimitExceeded("server_busy", "this server is tracking its maximum number of clients; "
                                                   "try again later")
            client = self._clients[address] = _Client()
        return client

    def _forget_idle(self, now: float) -> None:
        """Drop addresses that hold no session and no handshake inside the window."""
        for address, c in list(self._clients.items()):
            if c.sessions == 0 and (not c.handshakes or c.handshakes[-1] <= now - WINDOW_S):
                del self._clients[address]
