"""The call records of recent sessions, bounded, each readable by its own principal only.

:class:`RecordStore` keeps one record (JSON bytes) per session: a put replaces it. Bounded three
ways: at most ``max_records`` records and ``max_bytes`` of them (the least recently put go first),
none older than ``max_age_s`` since its last put, and none over ``max_record_bytes``. A record is
given only to the principal its session had (``pipeline.door.auth.Authenticator.principal``); a
phone call's (``CARRIER``) to any client with a token. Any other asks, and a record not held, get
the same answer (:class:`NoRecord`), so whether a session exists is not told to others.
``deployments/session_store.py`` serves one to every gateway replica.
"""
from __future__ import annotations

import time
from collections import OrderedDict
from typing import Callable, Protocol

CARRIER = "carrier"  # the principal of a phone call's session: the operator's, any token reads it


class NoRecord(Exception):
    """No record of that session for this principal."""


class RecordStore:
    def __init__(self, max_records: int = 10_000, max_bytes: int = 256 << 20, max_age_s: float = 24 * 3600,
                 max_record_bytes: int = 1 << 20, clock: Callable[[], float] = time.monotonic):
        self.max_records, self.max_bytes, self.max_age_s = max_records, max_bytes, max_age_s
        self.max_record_bytes, self.clock = max_record_bytes, clock
        self._records: OrderedDict[str, tuple[str, bytes, float]] = OrderedDict()  # id -> (principal, blob, put at)
        self.bytes = 0

    def put(self, session_id: str, principal: str, blob: bytes) -> bool:
        """Keep ``blob`` as the session's record; False (nothing kept) where it is over the size limit
        or the session's record is another principal's."""
        held = self._records.get(session_id)
        if len(blob) > self.max_record_bytes or (held is not None and held[0] != principal):
            return False
        if held is not None:
            self._drop(session_id)
        self._records[session_id] = (principal, blob, self.clock())
        self.bytes += len(blob)
        self._expire()
        while len(self._records) > self.max_records or self.bytes > self.max_bytes:
            self._drop(next(iter(self._records)))
        return True

    def get(self, session_id: str, principal: str) -> bytes:
        self._expire()
        held = self._records.get(session_id)
        if held is None or not readable(held[0], principal):
            raise NoRecord(f"no record of session {session_id[:64]!r} for this client")
        return held[1]

    def __len__(self) -> int:
        return len(self._records)

    def _expire(self) -> None:
        now = self.clock()
        while self._records:
            oldest = next(iter(self._records))
            if now - self._records[oldest][2] <= self.max_age_s:
                break
            self._drop(oldest)

    def _drop(self, session_id: str) -> None:
        self.bytes -= len(self._records.pop(session_id)[1])


def readable(owner: str, asker: str) -> bool:
    """Whether ``asker`` may read a record its session's ``owner`` left."""
    return asker == owner or (owner == CARRIER and asker.startswith("token:"))


class Records(Protocol):
    """A record store as a gateway reaches it (in-process, or through Ray: deployments/session_store.py)."""

    async def put_record(self, session_id: str, principal: str, blob: bytes) -> bool: ...
    async def get_record(self, session_id: str, principal: str) -> bytes | None: ...  # None: NoRecord


class LocalRecords:
    """A :class:`RecordStore` in this process, behind the async interface."""

    def __init__(self, store: RecordStore | None = None):
        self.records = store if store is not None else RecordStore()

    async def put_record(self, session_id: str, principal: str, blob: bytes) -> bool:
        return self.records.put(session_id, principal, blob)

    async def get_record(self, session_id: str, principal: str) -> bytes | None:
        try:
            return self.records.get(session_id, principal)
        except NoRecord:
            return None
