"""A live session's call record, put to the record store beside the conversation.

One :class:`RecordKeeper` per connection (``pipeline.connection.serve_connection`` makes it, for
every protocol). At most every ``PUT_EVERY_S`` it puts the record if it changed, one put in flight
at a time and each bounded in time, and once more when the connection ends. The store being slow or
gone never holds up the conversation: a failed put is counted and logged, and the next change
tries again; nothing is queued.
"""
from __future__ import annotations

import asyncio
import json
import logging

from pipeline.engines import bounded
from pipeline.records.store import Records

log = logging.getLogger(__name__)
PUT_EVERY_S = 2.0
STORE_TIMEOUT_S = 2.0


class RecordKeeper:
    """``resumed``: the session resumed a dropped one, whose record it continues (fetched first)."""

    def __init__(self, records: Records, record, principal: str, transport: str, resumed: bool = False):
        self.records, self.record, self.principal, self.transport = records, record, principal, transport
        self.resumed = resumed
        self.failed_puts = 0
        self._put_version = -1
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._keep(), name=f"record-{self.record.session_id}")

    async def _keep(self) -> None:
        if self.resumed:
            await self._continue()
        while True:
            await asyncio.sleep(PUT_EVERY_S)  # a period, not a synchronisation: puts are coalesced
            await self.put()

    async def put(self) -> None:
        version = self.record.version
        if version == self._put_version:
            return
        blob = json.dumps(dict(self.record.as_dict(), transport=self.transport), separators=(",", ":")).encode()
        try:
            if await bounded(self.records.put_record(self.record.session_id, self.principal, blob), STORE_TIMEOUT_S):
                self._put_version = version
            else:
                log.warning("record of %s: not kept (%d bytes: over the store's limit, or not ours)",
                            self.record.session_id, len(blob))
                self._put_version = version  # the same record would be refused again
        except Exception as exc:  # noqa: BLE001 - the store is slow or gone: the next change tries again
            self.failed_puts += 1
            log.warning("record of %s: the store did not take it: %s: %s", self.record.session_id,
                        type(exc).__name__, exc)

    async def _continue(self) -> None:
        """The record the dropped connection left, continued (none, or a store that does not answer:
        this one starts afresh, and replaces it at its first put)."""
        try:
            earlier = await bounded(self.records.get_record(self.record.session_id, self.principal), STORE_TIMEOUT_S)
        except Exception as exc:  # noqa: BLE001 - the store is slow or gone
            log.warning("record of %s: the earlier record was not had: %s", self.record.session_id, exc)
            return
        if earlier is not None:
            self.record.continue_from(json.loads(earlier))
        self.resumed = False

    async def finish(self) -> None:
        """The connection ended: the last record is put (bounded in time)."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if self.resumed:  # ended before the earlier record was had: not put over it without it
            await self._continue()
        await self.put()
