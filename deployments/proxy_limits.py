"""WebSocket limits in Ray Serve's HTTP proxy, where a message is read before any of our code sees it.

Ray Serve's proxy runs uvicorn with its defaults: messages up to 16 MiB, permessage-deflate on,
32 messages queued per connection, and it drains each connection's messages into a queue the
gateway replica pulls from. Serve's ``HTTPOptions`` expose none of these settings, so a client's
oversized or deflate-bombed messages would be read whole and buffered before the gateway's own
64 KiB frame check could refuse them.

Ray runs ``RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH`` in each proxy process before it starts its
HTTP server (it is meant to return middlewares); :func:`configure` uses that moment to give the
proxy's uvicorn our limits as its defaults. Set the variable in the environment Ray starts in
(``scripts/serve.sh`` does it for ``serve run``; ``ray start`` and the KubeRay manifest need it too):

    RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH=deployments.proxy_limits.configure

A message over ``MAX_WS_MESSAGE_BYTES`` then closes its connection with 1009 as its first bytes
arrive (the websockets library checks the frame's declared length, and the inflated size, before
reading further), and each connection holds at most ``WS_MAX_QUEUE`` messages in uvicorn.
"""
from __future__ import annotations

import functools
import logging

from pipeline.protocol import MAX_WS_MESSAGE_BYTES

ENV = "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH"
CALLBACK = "deployments.proxy_limits.configure"
WS_MAX_QUEUE = 16  # messages read ahead per connection (uvicorn's default: 32)
UVICORN_LIMITS = {
    "ws_max_size": MAX_WS_MESSAGE_BYTES,
    "ws_max_queue": WS_MAX_QUEUE,
    # Audio does not compress; inflating costs CPU and is what a small deflated message abuses.
    "ws_per_message_deflate": False,
}
log = logging.getLogger(__name__)


def configure() -> list:
    """The proxy's callback: uvicorn's WebSocket limits become ours (returns no middleware)."""
    import uvicorn

    original = uvicorn.Config.__init__
    if getattr(original, "gapless_limits", False):
        return []

    @functools.wraps(original)
    def init(self, *args, **kwargs):
        for name, value in UVICORN_LIMITS.items():
            kwargs.setdefault(name, value)
        original(self, *args, **kwargs)

    init.gapless_limits = True
    uvicorn.Config.__init__ = init
    log.info("proxy WebSocket limits: %s", UVICORN_LIMITS)
    return []
