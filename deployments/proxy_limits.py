"""Limits in Ray Serve's HTTP proxy, where a connection is read before any of our code sees it.

Ray Serve's proxy runs uvicorn with its defaults, and Serve's ``HTTPOptions`` expose none of them:

- **WebSocket messages** up to 16 MiB, permessage-deflate on, 32 messages queued per connection,
  drained into a queue the gateway replica pulls from: a client's oversized or deflate-bombed
  messages would be read whole and buffered before the gateway's own 64 KiB frame check could
  refuse them. Here a message over ``MAX_WS_MESSAGE_BYTES`` closes its connection with 1009 as
  its first bytes arrive (the websockets library checks the frame's declared length, and the
  inflated size, before reading further), deflate is off, and each connection holds at most
  ``WS_MAX_QUEUE`` messages in uvicorn.
- **Request heads** without any bound: uvicorn arms no timer before a request's head is complete
  (its keep-alive timeout starts only after a response), and its httptools parser (the one the
  proxy runs wherever httptools is installed) keeps any number of header bytes. A client that
  opens TCP and sends half an upgrade request, never the final CRLF, held its connection for good.
  Here the proxy's HTTP protocol is uvicorn's own with :class:`HeadDeadline` mixed in: a
  connection whose request head is not complete ``HANDSHAKE_TIMEOUT_S`` after it was made (on a
  kept-alive connection: after the next request's first byte), or that has sent more than
  ``MAX_HEAD_BYTES`` of it, is closed. Idle kept-alive connections stay uvicorn's business.
  No per-address bound: behind a reverse proxy every client shares its address, and the deadline
  already bounds how long any connection waits for its head.

Ray runs ``RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH`` in each proxy process before it starts its
HTTP server (it is meant to return middlewares); :func:`configure` uses that moment to make these
the defaults of the proxy's ``uvicorn.Config`` (what Ray passes itself still wins). The variable
must be in the environment Ray starts in:

    RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH=deployments.proxy_limits.configure

scripts/install.sh puts a ``.pth`` file in the environment that sets it at every interpreter
start unless it is set already (deployments/door_env.py), so ``serve run`` and ``ray start`` from
that environment have it; the KubeRay manifest sets it in its containers too.
"""
from __future__ import annotations

import functools
import logging

from pipeline.protocol import MAX_WS_MESSAGE_BYTES

ENV = "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH"
CALLBACK = "deployments.proxy_limits.configure"
WS_MAX_QUEUE = 16  # messages read ahead per connection (uvicorn's default: 32)
HANDSHAKE_TIMEOUT_S = 10.0  # a request head must be complete this long after the connection (or its first byte)
MAX_HEAD_BYTES = 64 * 1024  # a request head's size (browsers send a few KiB; reverse proxies allow 8-32 KiB)
UVICORN_LIMITS = {
    "ws_max_size": MAX_WS_MESSAGE_BYTES,
    "ws_max_queue": WS_MAX_QUEUE,
    # Audio does not compress; inflating costs CPU and is what a small deflated message abuses.
    "ws_per_message_deflate": False,
}
log = logging.getLogger(__name__)


class HeadDeadline:
    """Mixed in before one of uvicorn's HTTP protocol classes (h11 or httptools; both keep
    ``self.loop``, ``self.transport`` and ``self.cycle``, the request in flight): closes the
    connection when a request head takes longer than ``HANDSHAKE_TIMEOUT_S`` or more than
    ``MAX_HEAD_BYTES``. A head is awaited while no request is in flight and the connection has
    not been upgraded (the transport then belongs to a WebSocket protocol)."""

    _head_timer = None
    _head_bytes = 0

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._head_timer = self.loop.call_later(HANDSHAKE_TIMEOUT_S, self._head_overdue)

    def data_received(self, data: bytes) -> None:
        awaiting = self._awaiting_head()
        if awaiting and self._head_timer is None:  # the next request on a kept-alive connection
            self._head_timer = self.loop.call_later(HANDSHAKE_TIMEOUT_S, self._head_overdue)
        super().data_received(data)
        if not self._awaiting_head():  # the head is complete (a request runs, or it was upgraded)
            self._stop_head_timer()
            self._head_bytes = 0
        elif awaiting:
            self._head_bytes += len(data)
            if self._head_bytes > MAX_HEAD_BYTES:
                self._head_overdue()

    def connection_lost(self, exc) -> None:
        self._stop_head_timer()
        super().connection_lost(exc)

    def _awaiting_head(self) -> bool:
        return (self.cycle is None or self.cycle.response_complete) and self.transport.get_protocol() is self

    def _stop_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_overdue(self) -> None:
        self._head_timer = None
        if not self.transport.is_closing():
            self.transport.close()


def http_protocol() -> type:
    """The HTTP protocol class uvicorn's ``http="auto"`` picks, with :class:`HeadDeadline`."""
    from uvicorn.protocols.http.auto import AutoHTTPProtocol

    return type(f"HeadDeadline{AutoHTTPProtocol.__name__}", (HeadDeadline, AutoHTTPProtocol), {})


def configure() -> list:
    """The proxy's callback: uvicorn's defaults become our limits (returns no middleware)."""
    import uvicorn

    original = uvicorn.Config.__init__
    if getattr(original, "gapless_limits", False):
        return []
    protocol = http_protocol()

    @functools.wraps(original)
    def init(self, *args, **kwargs):
        for name, value in UVICORN_LIMITS.items():
            kwargs.setdefault(name, value)
        if not kwargs.get("http2"):  # HTTP/2 is uvicorn's zttp protocol, not this one
            kwargs.setdefault("http", protocol)
        original(self, *args, **kwargs)

    init.gapless_limits = True
    uvicorn.Config.__init__ = init
    log.info("proxy limits: %s, request heads within %.0f s and %d bytes", UVICORN_LIMITS, HANDSHAKE_TIMEOUT_S,
             MAX_HEAD_BYTES)
    return []
