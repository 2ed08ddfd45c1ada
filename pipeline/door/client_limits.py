"""Per-client limits on a gateway replica: concurrent sessions and handshakes per minute.

A client is its network address as the gateway sees it. Both limits are checked before a
WebSocket is accepted, so a client over them costs nothing but the refusal, and one client's
limits never touch another's. Memory is bounded: an address is remembered only while it holds
sessions or has handshakes inside the last minute, and at most ``max_clients`` addresses at once:
a new address past that forgets the least recently seen address that holds no session (its
handshake count starts again), in constant time, so a flood of new addresses never refuses or
slows anyone else.
"""
from __future__ import annotations

import time
from collections import OrderedDict, deque
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
        self._clients: OrderedDict[str, _Client] = OrderedDict()  # least recently seen first

    def handshake(self, address: str) -> None:
        """Count one handshake (or ticket request) of ``address``; LimitExceeded over the rate."""
        now = self.clock()
        self.check_rate(address)
        self._client(address, now).handshakes.append(now)

    def check_rate(self, address: str) -> None:
        """LimitExceeded if ``address`` has used its handshakes of the last minute (counts nothing,
        remembers nothing new)."""
        client = self._clients.get(address)
        if client is None:
            return
        now = self.clock()
        while client.handshakes and client.handshakes[0] <= now - WINDOW_S:
            client.handshakes.popleft()
        if len(client.handshakes) >= self.per_minute:
            wait = client.handshakes[0] + WINDOW_S - now
            raise LimitExceeded("too_many_handshakes",
                                f"more than {self.per_minute} connection attempts a minute from this address; "
                                f"try again in {wait:.0f} s")

    def forgive(self, address: str) -> None:
        """Take back ``address``'s latest handshake (an attempt counted before it was known good)."""
        client = self._clients.get(address)
        if client is not None and client.handshakes:
            client.handshakes.pop()

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
        if client is not None:
            self._clients.move_to_end(address)
            return client
        if len(self._clients) >= self.max_clients:
            self._forget_one()
        client = self._clients[address] = _Client()
        return client

    def _forget_one(self) -> None:
        """Forget the least recently seen address that holds no session. Addresses holding
        sessions are passed over: at most the replica's sessions, so this stays short."""
        for address, c in self._clients.items():
            if c.sessions == 0:
                del self._clients[address]
                return
        raise LimitExceeded("server_busy", "every client this server tracks holds a session; try again later")
