"""The ticket ledger: one record of redeemed tickets that every gateway replica shares.

A ticket (pipeline/door/auth.py) opens one connection. Each gateway replica checks a ticket's signature
and age itself; whether it was used already is asked here, of a single replica, so a ticket cannot
open one connection on each gateway replica. Records expire with their tickets (at most
``auth.ticket_ttl_s``), so the ledger holds at most the tickets redeemed within one lifetime; each
claim is a dictionary lookup on this replica's event loop.

Its loss is survivable and fails closed: a gateway that cannot reach the ledger refuses tickets
(``server_busy``) until Serve has replaced it; bearer tokens do not need it. A replaced ledger starts
empty, so a ticket redeemed before the loss could open one more connection within its lifetime.
At larger scale an external store does the same with one command (Redis ``SET nonce 1 NX PXAT``).
"""
from __future__ import annotations

import time

from ray import serve

from pipeline.door.auth import LocalRedeemed


@serve.deployment(num_replicas=1, ray_actor_options={"num_cpus": 0}, max_ongoing_requests=1000)
class TicketLedger:
    def __init__(self):
        self.redeemed = LocalRedeemed(time.time)

    async def claim(self, nonce: str, until: float) -> bool:
        """True the first time ``nonce`` is claimed (before ``until``, Unix seconds), else False."""
        return self.redeemed.claim(nonce, until)

    async def ready(self) -> bool:
        return True
