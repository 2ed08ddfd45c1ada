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
- **Request bodies** (:class:`BodyLimits`, the ASGI middleware the callback returns): each HTTP
  request's body is read whole here, before the request is passed on to the gateway replica, at
  most its route's size and within ``BODY_TIMEOUT_S`` of its head (``pipeline/door/bodies.py``), and
  each route holds at most its budget of requests at once. Without it, a body sent a byte at a
  time held one of the replica's ongoing requests for as long as the client liked: 1,050 of them
  to the phone webhook stalled every route of the replica, /healthz included.

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

import asyncio
import functools
import json
import logging
import time
from collections import Counter

from starlette.middleware import Middleware

from pipeline.door.bodies import BODY_TIMEOUT_S, MAX_BODIES_PER_ADDRESS, ROUTES, Route
from pipeline.adapters.v1.protocol import MAX_WS_MESSAGE_BYTES

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


class BodyLimits:
    """ASGI middleware of the proxy (``pipeline/door/bodies.py`` has the routes and their bounds). An
    anonymous request's body is read whole here before the request goes on (to Ray's proxy, then
    the gateway replica), replayed to it as one message; one with an ``Authorization`` header to a
    route that checks it first streams on, under the same bounds. Refused here, and the connection
    closed: a body over its route's size (413, as soon as the declared length or the bytes read
    pass it), one not complete within ``BODY_TIMEOUT_S`` (408), an anonymous request to a route at
    its budget, or from an address with ``MAX_BODIES_PER_ADDRESS`` anonymous bodies still arriving
    (503). A request without a body, and every WebSocket, passes untouched. Behind a reverse proxy
    every client shares its address: let it buffer bodies (nginx's default), so that they arrive
    here whole and at once."""

    LOG_EVERY_S = 10.0

    def __init__(self, app, routes: tuple[Route, ...] = ROUTES):
        self.app = app
        self.routes = routes
        self.in_flight: Counter[str] = Counter()  # route name -> anonymous requests in flight
        self.arriving: Counter[str] = Counter()  # client address -> anonymous bodies still arriving
        self.refused: Counter[str] = Counter()  # (logged now and then, not per request)
        self._logged_at = 0.0

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        route = next(r for r in self.routes if r.matches(scope["method"], scope["path"]))
        address = (scope.get("client") or ("",))[0]
        headers = dict(scope.get("headers") or ())
        declared = headers.get(b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > route.max_bytes):
            await self._refuse(send, route, 413, "body_too_large", f"this request's body may be at most "
                               f"{route.max_bytes} bytes")
            return
        if declared in (None, b"0") and b"transfer-encoding" not in headers:
            await self.app(scope, receive, send)  # no body (a GET, a probe): nothing to wait for
            return
        anonymous = not (route.credentials_first and headers.get(b"authorization"))
        if anonymous and (self.in_flight[route.name] >= route.max_in_flight
                          or self.arriving[address] >= MAX_BODIES_PER_ADDRESS):
            await self._refuse(send, route, 503, "server_busy", "this server has too many requests of this kind in "
                               "flight; try again shortly")
            return
        if not anonymous:
            await self._stream(scope, receive, send, route, address)
            return
        self.in_flight[route.name] += 1
        try:
            body = await self._body(receive, send, route, address)
            if body is not None:
                await self.app(scope, _replay(body, receive), send)
        finally:
            self.in_flight[route.name] -= 1

    async def _body(self, receive, send, route: Route, address: str) -> bytes | None:
        """The whole body, or None once the request was refused."""
        self._arrives(address, 1)
        body = bytearray()
        try:
            async with asyncio.timeout(BODY_TIMEOUT_S):
                while True:
                    message = await receive()
                    if message["type"] == "http.disconnect":
                        return None
                    body += message.get("body", b"")
                    if len(body) > route.max_bytes:
                        await self._too_large(send, route)
                        return None
                    if not message.get("more_body", False):
                        return bytes(body)
        except TimeoutError:
            await self._too_slow(send, route)
            return None
        finally:
            self._arrives(address, -1)

    async def _stream(self, scope, receive, send, route: Route, address: str) -> None:
        """The request goes on at once; its body streams through under the route's size and the
        deadline. Past either, the client is answered here and the app sees a disconnect."""
        # Over 40 lines as one function: the body's state, shared by the two closures that pass it on.
        deadline = asyncio.get_running_loop().time() + BODY_TIMEOUT_S
        state = {"read": 0, "complete": False, "answered": False, "started": False}

        def body_done() -> None:
            state["complete"] = True

        async def bounded_receive():
            if state["answered"]:
                return {"type": "http.disconnect"}
            if state["complete"]:
                return await receive()
            try:
                async with asyncio.timeout_at(deadline):
                    message = await receive()
            except TimeoutError:
                body_done()
                if not state["started"]:
                    state["answered"] = True
                    await self._too_slow(send, route)
                return {"type": "http.disconnect"}
            if message["type"] != "http.request":
                body_done()
                return message
            state["read"] += len(message.get("body", b""))
            if state["read"] > route.max_bytes:
                body_done()
                if not state["started"]:
                    state["answered"] = True
                    await self._too_large(send, route)
                return {"type": "http.disconnect"}
            if not message.get("more_body", False):
                body_done()
            return message

        async def guarded_send(message) -> None:
            if state["answered"]:
                return  # we answered already: the app's late words go nowhere
            state["started"] = True
            await send(message)

        try:
            await self.app(scope, bounded_receive, guarded_send)
        finally:
            body_done()

    def _arrives(self, address: str, change: int) -> None:
        self.arriving[address] += change
        if not self.arriving[address]:
            del self.arriving[address]

    async def _too_large(self, send, route: Route) -> None:
        await self._refuse(send, route, 413, "body_too_large", f"this request's body may be at most "
                           f"{route.max_bytes} bytes")

    async def _too_slow(self, send, route: Route) -> None:
        await self._refuse(send, route, 408, "body_timeout", f"the request's body must arrive within "
                           f"{BODY_TIMEOUT_S:g} s of its head")

    async def _refuse(self, send, route: Route, status: int, code: str, message: str) -> None:
        self.refused[f"{route.name} {status}"] += 1
        now = time.monotonic()
        if now - self._logged_at >= self.LOG_EVERY_S:
            self._logged_at = now
            log.warning("proxy body limits: refused so far %s", dict(self.refused))
        body = json.dumps({"error": {"type": "invalid_request_error", "code": code, "message": message}}).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                   (b"connection", b"close")]  # a body left unread: the connection is not kept
        if status == 503:
            headers.append((b"retry-after", b"1"))
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})


def _replay(body: bytes, receive):
    """A ``receive`` that gives the body read as one message, then the connection's own (a
    disconnect)."""
    sent = False

    async def replay():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


def http_protocol() -> type:
    """The HTTP protocol class uvicorn's ``http="auto"`` picks, with :class:`HeadDeadline`."""
    from uvicorn.protocols.http.auto import AutoHTTPProtocol

    return type(f"HeadDeadline{AutoHTTPProtocol.__name__}", (HeadDeadline, AutoHTTPProtocol), {})


def configure() -> list:
    """The proxy's callback: uvicorn's defaults become our limits; returns the body limits'
    middleware."""
    import uvicorn

    original = uvicorn.Config.__init__
    if getattr(original, "gapless_limits", False):
        return [Middleware(BodyLimits)]
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
    log.info("proxy limits: %s, request heads within %.0f s and %d bytes, bodies within %.0f s", UVICORN_LIMITS,
             HANDSHAKE_TIMEOUT_S, MAX_HEAD_BYTES, BODY_TIMEOUT_S)
    return [Middleware(BodyLimits)]
