"""The session store: the snapshots of resumable conversations, and the call records of every
session (pipeline/records/store.py), shared by every gateway replica.

A conversation's gateway replica puts a snapshot here after each turn (pipeline/resume/keeper.py); a
client that lost its connection, or whose replica drained, resumes on whichever replica Ray's proxy
gives it, which takes the snapshot from here (pipeline/resume/tokens.py). One replica, one
:class:`~pipeline.resume.tokens.SnapshotStore` in its memory: each call is a few dictionary operations on
its event loop, and it is bounded (entries, bytes, and the resume window).

Why a Serve deployment: it lives and is health-checked with the app, needs nothing else to run,
and every gateway already talks to deployments through handles; a put is one handle call beside
the conversation. What it does not give: its snapshots live in its replica's memory. When Serve
replaces it (an app redeploy may), the sessions still connected are put again by their gateways
within ``resume_window_s / 3`` (a touch finds them unknown), and a draining gateway retries its
last snapshots for a few seconds until the new replica takes them; the snapshots of sessions
already dropped are lost (their resume is refused as expired, and the client starts afresh).
And one replica serves every gateway. At larger scale, or where a resume must survive the store's own
loss, an external store does the same with a key per session (Redis: ``SET`` with ``PX`` of the
window, a generation compared and moved on atomically in a Lua script or ``WATCH``/``MULTI``),
replicated, and shared by several Ray clusters.
"""
from __future__ import annotations

from ray import serve

from pipeline.records.store import LocalRecords, RecordStore
from pipeline.resume.tokens import LocalSnapshots, ResumeRefused, SnapshotStore


class RaySnapshots:
    """The store as a gateway reaches it (``pipeline.resume.tokens.Snapshots``) through its handle."""

    def __init__(self, handle):
        self.handle = handle

    async def put(self, session_id: str, generation: int, principal: str, digest: str, blob: bytes) -> bool:
        return await self.handle.put.remote(session_id, generation, principal, digest, blob)

    async def touch(self, session_ids: list[str], generations: list[int] | None = None) -> list[str]:
        return await self.handle.touch.remote(session_ids, generations)

    async def held_generation(self, session_id: str) -> int | None:
        return await self.handle.held_generation.remote(session_id)

    async def take(self, token: str, principal: str) -> tuple[bytes, int]:
        blob, answer = await self.handle.take.remote(token, principal)
        if blob is None:
            raise ResumeRefused(*answer)
        return blob, answer


class RayRecords:
    """The call records as a gateway reaches them (``pipeline.records.store.Records``) through the handle."""

    def __init__(self, handle):
        self.handle = handle

    async def put_record(self, session_id: str, principal: str, blob: bytes) -> bool:
        return await self.handle.put_record.remote(session_id, principal, blob)

    async def get_record(self, session_id: str, principal: str) -> bytes | None:
        return await self.handle.get_record.remote(session_id, principal)


@serve.deployment(num_replicas=1, ray_actor_options={"num_cpus": 0}, max_ongoing_requests=1000)
class SessionStore(LocalSnapshots, LocalRecords):
    """The store's replica: ``LocalSnapshots``' and ``LocalRecords``' methods (the sessions' call
    records, pipeline/records/store.py), served to every gateway replica."""

    def __init__(self, window_s: float = 30.0, max_entries: int = 10_000, max_bytes: int = 256 << 20,
                 records: dict | None = None):
        LocalSnapshots.__init__(self, SnapshotStore(window_s=window_s, max_entries=max_entries, max_bytes=max_bytes))
        LocalRecords.__init__(self, RecordStore(**(records or {})))

    async def take(self, token: str, principal: str) -> tuple[bytes, int] | tuple[None, tuple[str, str]]:
        """(snapshot, generation), or (None, (reason, message)) for a refusal: an exception's own
        type does not survive the trip back through Ray."""
        try:
            return await super().take(token, principal)
        except ResumeRefused as refused:
            return None, (refused.reason, str(refused))

    async def ready(self) -> bool:
        return True
