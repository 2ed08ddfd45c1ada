"""A live session kept resumable: its snapshots go to the shared store as the conversation changes.

One :class:`Keeper` per resumable connection (``pipeline.connection.serve_connection`` makes it).
It makes the session's resume token, puts a snapshot after each change of what a resumed
conversation starts from (the core sets ``state_changed``: a turn, a reply remembered, a setting,
the voice context), at most one put in flight (changes meanwhile are coalesced into the next),
tells the store the session is alive while nothing changes (and puts it again if the store no
longer knows it: a replaced store replica), and puts a last one, with the reply that was in
flight, when the connection ends. The store being slow or gone never holds up the conversation:
puts run beside it, each bounded in time; a failed one is logged and the next change tries again.
"""
from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

from pipeline.engines import bounded
from pipeline.conversation.snapshot import Snapshot
from pipeline.resume.tokens import ResumeRefused, Snapshots, new_token

log = logging.getLogger(__name__)
STORE_TIMEOUT_S = 2.0
LAST_SAVE_S = 5.0  # the last snapshot is tried again this long (a store replica being replaced)


@dataclass
class Continuity:
    """What a gateway replica needs to keep its sessions resumable: the shared store and the window
    a dropped session stays resumable (the store's ``window_s``)."""

    snapshots: Snapshots
    window_s: float

    async def take(self, token: str, principal: str) -> tuple[Snapshot, int]:
        """The snapshot a resume token unlocks and the generation the resumed session holds, or
        ResumeRefused; a store that does not answer raises EngineUnavailable."""
        blob, generation = await bounded(self.snapshots.take(token, principal), STORE_TIMEOUT_S)
        return Snapshot.loads(blob), generation


class Keeper:
    def __init__(self, continuity: Continuity, session, principal: str, generation: int = 0):
        self.continuity, self.session, self.principal, self.generation = continuity, session, principal, generation
        self.token: str | None = None
        self._digest = ""  # of the token's secret, kept by the store with the snapshot
        self._task: asyncio.Task | None = None
        self._finished = False

    def start(self) -> None:
        """Make the session's resume token (told in session.ready) and start keeping it."""
        self.token, self._digest = new_token(self.session.id, self.generation)
        fields = {"resume_token": self.token, "resume_window_s": self.continuity.window_s}
        if self.generation > 0:  # a resumed conversation: where it had got to
            fields.update(resumed=True, turn=self.session.core.shared.turn)
        self.session.resume_fields = fields
        self.session.core.changed.set()  # the first snapshot: a drop before any turn resumes too
        self._task = asyncio.create_task(self._keep(), name=f"keeper-{self.session.id}")

    async def _keep(self) -> None:
        changed = self.session.core.changed
        while not self._finished:
            try:
                await asyncio.wait_for(changed.wait(), timeout=self.continuity.window_s / 3)
            except asyncio.TimeoutError:
                if await self._call(self.continuity.snapshots.touch([self.session.id], [self.generation])):
                    changed.set()  # unknown to the store (a new store replica), or resumed elsewhere: put
                continue
            if self._finished:
                return
            changed.clear()
            if await self.save() is False and await self._resumed_elsewhere():
                self.session.replaced()  # a newer connection resumed this session: this one leaves
                return

    async def save(self, in_flight: bool = False) -> bool | None:
        """Put the conversation as it is now: True if the store took it, False if it refused it (a
        resume replaced this session, or the snapshot is too large), None if it did not answer."""
        blob = self.session.core.snapshot(in_flight).dumps()
        return await self._call(self.continuity.snapshots.put(self.session.id, self.generation, self.principal,
                                                              self._digest, blob))

    async def _resumed_elsewhere(self) -> bool:
        held = await self._call(self.continuity.snapshots.held_generation(self.session.id))
        return held is not None and held > self.generation

    async def finish(self) -> None:
        """The connection ended: the last snapshot, with the reply that was in flight (once)."""
        if self._finished:
            return
        self._finished = True
        if self._task is not None:  # it ends at its next look (a put in flight finishes first)
            self.session.core.changed.set()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        deadline = asyncio.get_running_loop().time() + LAST_SAVE_S
        while await self.save(in_flight=True) is None and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.25)  # no answer: the store's replica may be being replaced

    async def _call(self, call):
        try:
            return await bounded(call, STORE_TIMEOUT_S)
        except (ResumeRefused, asyncio.CancelledError):
            raise
        except Exception as exc:  # noqa: BLE001 - the store is an improvement, never a failure
            log.warning("session %s: the session store: %s: %s", self.session.id, type(exc).__name__, exc)
            return None
