"""What an HTTP request's body may be, route by route (docs/webrtc.md and docs/phone.md state
each bound). Ray Serve's HTTP proxy enforces these before a request reaches the gateway replica
(``deployments/proxy_limits.py``): it reads each body whole, at most the route's ``max_bytes``
and within ``BODY_TIMEOUT_S`` of the request's head, declared (``Content-Length``) or chunked, and
holds at most ``max_in_flight`` anonymous requests of a route at once (``MAX_BODIES_PER_ADDRESS``
bodies still arriving from one address). A slow or oversized body is answered by the proxy (408,
413) and never reaches the replica; a route past its budget is answered 503 at once.

A request with an ``Authorization`` header to a route whose handler checks that credential before
it reads the body (``credentials_first``) is not held back: its body streams through to the
replica under the same size and deadline, and outside the anonymous budget, so that a flood of
anonymous slow bodies never costs a token holder its offer. A false credential costs next to
nothing where auth is on: the gateway refuses it (401) before it reads a byte of the body. Where
auth is off (any credential passes), the replica reads at most ``MAX_BODIES_READING`` such bodies at
once, each within ``BODY_TIMEOUT_S``: the replica's request slots and event loop stay free.

The routes match whole paths: the app is served at ``route_prefix: /`` (both serve configs).

The sizes are the smallest real clients need, with room to spare: a browser's SDP offer (audio
and the data channel) is 2-6 KB, Twilio's webhook form a few hundred bytes, and a Realtime session
object at most ``MAX_SESSION_JSON_BYTES`` (the cap ``session.update`` has too).
"""
from __future__ import annotations

import re
from dataclasses import dataclass

BODY_TIMEOUT_S = 5.0  # from the request's head complete to its body complete
MAX_BODIES_PER_ADDRESS = 8  # bodies still arriving from one client address, at once
MAX_SDP_BYTES = 16 * 1024  # an SDP offer (browsers send 2-6 KB; each extra candidate ~100 bytes)
MAX_SESSION_JSON_BYTES = 64 * 1024  # a Realtime session object as JSON (= the realtime settings' cap)
MAX_FORM_BYTES = 8 * 1024  # a carrier's webhook form (Twilio's is a few hundred bytes)
MULTIPART_SLACK = 4 * 1024  # boundaries and part headers around a multipart offer's parts
MAX_OTHER_BYTES = 1024  # every other route: a ticket request, a hang-up, GETs (none needs a body)
# Bodies a gateway replica reads at once (those that stream through the proxy with a credential,
# which auth mode none does not check): past it, 503 at once; each within BODY_TIMEOUT_S.
MAX_BODIES_READING = 64


@dataclass(frozen=True)
class Route:
    """A budget of the proxy: requests to ``method path`` (``path`` a regular expression, matched
    whole), their bodies at most ``max_bytes``, at most ``max_in_flight`` at once."""

    name: str
    method: str | None  # None: any
    path: re.Pattern | None  # None: any
    max_bytes: int
    max_in_flight: int  # anonymous requests at once
    credentials_first: bool = True  # the gateway checks a bearer credential before reading the body

    def matches(self, method: str, path: str) -> bool:
        return (self.method is None or method == self.method) and (self.path is None or bool(self.path.fullmatch(path)))


ROUTES = (
    # Anonymous by nature: a carrier calls its webhook without our credentials.
    Route("phone_webhook", "POST", re.compile(r"/v1/phone/[^/]+/voice"), MAX_FORM_BYTES, 32, credentials_first=False),
    # Anonymous where auth is off; an SDP, or multipart with the SDP and a session object.
    Route("webrtc_offer", "POST", re.compile(r"/v1/realtime/calls"),
          MAX_SDP_BYTES + MAX_SESSION_JSON_BYTES + MULTIPART_SLACK, 32),
    Route("client_secret", "POST", re.compile(r"/v1/realtime/client_secrets"), MAX_SESSION_JSON_BYTES + 1024, 64),
    Route("other", None, None, MAX_OTHER_BYTES, 512),
)

