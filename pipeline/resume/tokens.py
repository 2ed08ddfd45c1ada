"""Conversations that outlive their connection: resume tokens and the snapshots they unlock.

A session that can be resumed (protocol v1) is given a **resume token** in ``session.ready``. After
every change that matters (a turn, a reply, a setting) its gateway puts a :class:`Snapshot` of the
conversation into a store every gateway replica shares, and once more when the connection ends.
A client that reconnects within ``resume_window_s`` with the token gets the conversation back, on
any gateway replica: history, agent settings (voice included), the TTS voice context, and its turn
numbers; a reply that was in flight ends at what the client reports it received.

The token is ``<session id>.<generation>.<secret>``, 128 random bits the session's gateway made;
the store keeps the secret's digest with the snapshot, and the principal (who connected: see
``pipeline.door.auth.Authenticator.principal``), so a token cannot be guessed, nor used with other
credentials. (In place of an HMAC under a shared key: that key would have to be the same on every
gateway and store replica and outlive their replacements; a digest kept with the snapshot needs
neither, and a gateway that finds the store replaced puts its sessions back, digests and all.)
Each resume takes a generation (the store holds one per session, and :meth:`SnapshotStore.take`
moves it on atomically), so a token resumes once: a second resume with it, at the same time or
later, is refused, and the session it replaced can no longer overwrite the snapshot. The resumed
session gets a new token for the next drop.

:class:`SnapshotStore` is the store's logic, framework-free and bounded: at most ``max_entries``
sessions and ``max_bytes`` of snapshots (the principal holding the most loses its oldest to be touched
first), each entry forgotten
``window_s`` after its session was last seen alive. ``deployments/session_store.py`` serves one
to every gateway replica.
"""
from __future__ import annotations

import hashlib
import hmac
import secrets
import time
from collections import Counter, OrderedDict
from dataclasses import dataclass
from typing import Callable, Protocol


RESUME_PARAM = "resume"  # the token, in the reconnecting handshake's query
RECEIVED_TURN_PARAM = "resume_turn"  # the turn of the last ``audio`` message the client received
RECEIVED_SEQ_PARAM = "resume_seq"  # ... and its seq
PARAMS = (RESUME_PARAM, RECEIVED_TURN_PARAM, RECEIVED_SEQ_PARAM)
MAX_TOKEN_CHARS = 200

# Why a resume is refused (the ``reason`` of ResumeRefused; the client starts afresh in every case).
BAD_TOKEN = "bad_token"  # not a token this server issued, or not for this principal
EXPIRED = "expired"  # no snapshot (the window passed, or the store lost it)
TAKEN = "already_resumed"  # the token was used already (one resume per token)


class ResumeRefused(Exception):
    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


def new_token(session_id: str, generation: int) -> tuple[str, str]:
    """A fresh resume token for the session at this generation, and its digest for the store."""
    secret = secrets.token_urlsafe(16)
    return f"{session_id}.{generation}.{secret}", _digest(secret)


def read_token(token: str) -> tuple[str, int, str]:
    """(session id, generation, the secret's digest), or ResumeRefused(bad_token) if malformed."""
    parts = token.split(".") if isinstance(token, str) and len(token) <= MAX_TOKEN_CHARS else []
    if len(parts) != 3 or not parts[1].isascii() or not parts[1].isdigit() or not parts[2]:
        raise ResumeRefused(BAD_TOKEN, "the resume token is not valid")
    return parts[0], int(parts[1]), _digest(parts[2])


def _digest(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


@dataclass
class _Entry:
    generation: int
    principal: str
    digest: str  # of the secret of the session's current token
    blob: bytes
    alive_at: float  # when its session was last seen alive (a put or a touch)


class SnapshotStore:
    """The shared record of resumable sessions (see the module docstring). Every method is a few
    dictionary operations; the store never blocks and never grows past its bounds."""

    def __init__(self, window_s: float = 30.0, max_entries: int = 10_000, max_bytes: int = 256 << 20,
                 max_snapshot_bytes: int = 8 << 20, clock: Callable[[], float] = time.time):
        self.window_s = window_s
        self.max_entries, self.max_bytes, self.max_snapshot_bytes = max_entries, max_bytes, max_snapshot_bytes
        self.clock = clock
        self._entries: OrderedDict[str, _Entry] = OrderedDict()  # least recently touched first
        self._held: Counter[str] = Counter()  # entries per principal (whose are evicted first)
        self.bytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, session_id: str, generation: int, principal: str, digest: str, blob: bytes) -> bool:
        """Keep ``blob`` as the session's snapshot, with who may resume it (``principal``, and the
        digest of its token's secret), unless a resume took the session past ``generation`` (the
        caller was replaced: False) or it is larger than one snapshot may be."""
        self._forget_expired()
        entry = self._entries.get(session_id)
        if entry is not None and entry.generation > generation:
            return False
        if len(blob) > self.max_snapshot_bytes:
            return False
        self.bytes += len(blob) - (len(entry.blob) if entry is not None else 0)
        if entry is not None:
            self._held[entry.principal] -= 1
        self._held[principal] += 1
        self._entries[session_id] = _Entry(generation, principal, digest, blob, self.clock())
        self._entries.move_to_end(session_id)
        self._bound()
        return True

    def touch(self, session_ids: list[str], generations: list[int] | None = None) -> list[str]:
        """These sessions are alive: their window starts again. Returns those it does not hold (a
        replaced store: their gateways put them again), and, given each one's generation, those a
        resume has taken past it (their puts will be refused: the session was replaced)."""
        now, unknown = self.clock(), []
        for i, sid in enumerate(session_ids):
            entry = self._entries.get(sid)
            if entry is None or (generations is not None and entry.generation > generations[i]):
                unknown.append(sid)
                continue
            entry.alive_at = now
            self._entries.move_to_end(sid)
        return unknown

    def held_generation(self, session_id: str) -> int | None:
        """The generation the store holds for a session (a resume raises it), None if it holds none."""
        entry = self._entries.get(session_id)
        return entry.generation if entry is not None else None

    def take(self, token: str, principal: str) -> tuple[bytes, int]:
        """Resume: the session's snapshot and the generation the resumed session holds, or
        ResumeRefused. The token's generation is used up here, whatever follows."""
        session_id, generation, digest = read_token(token)
        self._forget_expired()
        entry = self._entries.get(session_id)
        if entry is None:
            raise ResumeRefused(EXPIRED, f"nothing to resume: the session ended more than {self.window_s:g} s ago "
                                         "or was never saved")
        if not (hmac.compare_digest(digest, entry.digest) and hmac.compare_digest(principal, entry.principal)):
            raise ResumeRefused(BAD_TOKEN, "the resume token is not valid for this client")
        if entry.generation != generation:
            raise ResumeRefused(TAKEN, "this resume token was used already; each token resumes once")
        entry.generation += 1
        entry.alive_at = self.clock()
        self._entries.move_to_end(session_id)
        return entry.blob, entry.generation

    def _forget_expired(self) -> None:
        horizon = self.clock() - self.window_s
        while self._entries:
            sid, entry = next(iter(self._entries.items()))
            if entry.alive_at > horizon:
                return
            self._drop(sid)

    def _bound(self) -> None:
        """Over a bound, the least recently alive snapshot of the principal holding the most goes:
        one client filling the store evicts its own sessions, not everyone else's."""
        while len(self._entries) > self.max_entries or self.bytes > self.max_bytes:
            most = max(self._held, key=self._held.__getitem__)
            self._drop(next(sid for sid, e in self._entries.items() if e.principal == most))

    def _drop(self, session_id: str) -> None:
        entry = self._entries.pop(session_id)
        self.bytes -= len(entry.blob)
        self._held[entry.principal] -= 1
        if not self._held[entry.principal]:
            del self._held[entry.principal]


class Snapshots(Protocol):
    """A :class:`SnapshotStore` as a session reaches it (in this process, or a Serve deployment)."""

    async def put(self, session_id: str, generation: int, principal: str, digest: str, blob: bytes) -> bool: ...
    async def touch(self, session_ids: list[str], generations: list[int] | None = None) -> list[str]: ...
    async def held_generation(self, session_id: str) -> int | None: ...
    async def take(self, token: str, principal: str) -> tuple[bytes, int]: ...


class LocalSnapshots:
    """A :class:`SnapshotStore` in this process, behind the async interface (tests, one gateway)."""

    def __init__(self, store: SnapshotStore | None = None):
        self.store = store if store is not None else SnapshotStore()

    async def put(self, session_id: str, generation: int, principal: str, digest: str, blob: bytes) -> bool:
        return self.store.put(session_id, generation, principal, digest, blob)

    async def touch(self, session_ids: list[str], generations: list[int] | None = None) -> list[str]:
        return self.store.touch(session_ids, generations)

    async def held_generation(self, session_id: str) -> int | None:
        return self.store.held_generation(session_id)

    async def take(self, token: str, principal: str) -> tuple[bytes, int]:
        return self.store.take(token, principal)


def received(query: dict[str, str]) -> tuple[int | None, int | None]:
    """The (turn, seq) of the last ``audio`` message a reconnecting client says it received."""
    def number(name: str) -> int | None:
        value = query.get(name)
        if value is None:
            return None
        if not (value.isascii() and value.isdigit() and len(value) <= 9):
            raise ValueError(f"{name} must be a non-negative integer, got {value!r}")
        return int(value)

    return number(RECEIVED_TURN_PARAM), number(RECEIVED_SEQ_PARAM)
