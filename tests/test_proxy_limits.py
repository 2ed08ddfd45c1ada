"""The limits deployments/proxy_limits.py gives Ray Serve's HTTP proxy, on a real uvicorn server
(in a thread, on a free loopback port, built after configure() as Ray's proxy builds its own): a
connection whose request head is incomplete is closed at HANDSHAKE_TIMEOUT_S (or past
MAX_HEAD_BYTES) while complete requests and upgraded WebSockets carry on; the WebSocket limits
stay. And the .pth of deployments/door_env.py, which gives every interpreter of the environment
the proxy's callback variable unless it is set."""
from __future__ import annotations

import asyncio
import contextlib
import os
import re
import select
import socket
import subprocess
import sys
import threading
import time

import pytest
import uvicorn

from deployments import door_env, proxy_limits
from pipeline.door.bodies import Route
from pipeline.adapters.v1.protocol import MAX_WS_MESSAGE_BYTES

MARGIN_S = 3.0  # scheduling slack on a loaded 2-core machine
PARTIAL_UPGRADE = (b"GET /v1/ws HTTP/1.1\r\nHost: 127.0.0.1\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                   b"Sec-WebSocket-Version: 13\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n")  # no final CRLF
UPGRADE = PARTIAL_UPGRADE + b"\r\n"
GET = b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"


async def _app(scope, receive, send):
    if scope["type"] == "http":
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
        await send({"type": "http.response.body", "body": b"ok"})
    elif scope["type"] == "websocket":
        await receive()  # websocket.connect
        await send({"type": "websocket.accept"})
        while (await receive())["type"] != "websocket.disconnect":
            pass


@contextlib.contextmanager
def _serving(app, **config):
    """``app`` served by uvicorn on a free loopback port in a thread; the port."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    srv = uvicorn.Server(uvicorn.Config(app, lifespan="off", log_config=None, **config))
    thread = threading.Thread(target=asyncio.run, args=(srv.serve(sockets=[sock]),), daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not srv.started and thread.is_alive() and time.monotonic() < deadline:
        time.sleep(0.02)  # poll for the start, under a deadline
    assert srv.started
    try:
        yield sock.getsockname()[1]
    finally:
        srv.should_exit = True
        thread.join(30)
        sock.close()


@pytest.fixture
def configured():
    """configure() applied to uvicorn.Config, undone afterwards (other tests build their own)."""
    original = uvicorn.Config.__init__
    proxy_limits.configure()
    yield
    uvicorn.Config.__init__ = original


@pytest.fixture
def server(configured):
    """A uvicorn server as the proxy runs it (Config defaults from configure()); its port."""
    with _serving(_app, timeout_keep_alive=30) as port:
        yield port


def _connect(port: int, data: bytes = b"") -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    if data:
        sock.sendall(data)
    return sock


def _closed_within(sock: socket.socket, seconds: float) -> bool:
    """Whether the server closes ``sock`` within ``seconds`` (anything it sends first is read)."""
    deadline = time.monotonic() + seconds
    while True:
        readable, _, _ = select.select([sock], [], [], max(0.0, deadline - time.monotonic()))
        if not readable:
            return False
        try:
            if sock.recv(65536) == b"":
                return True
        except ConnectionResetError:
            return True


def _response(sock: socket.socket) -> bytes:
    """The status line and headers the server answers on ``sock``."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(4096)
        assert chunk, data
        data += chunk
    return data


def test_half_sent_heads_are_closed_at_the_timeout_while_complete_requests_are_answered(server, monkeypatch):
    timeout_s = 0.5
    monkeypatch.setattr(proxy_limits, "HANDSHAKE_TIMEOUT_S", timeout_s)
    start = time.monotonic()
    stalled = [_connect(server, PARTIAL_UPGRADE if i % 2 else b"") for i in range(20)]
    try:
        with _connect(server, GET) as ok:
            assert _response(ok).startswith(b"HTTP/1.1 200")
        assert all(_closed_within(sock, timeout_s + MARGIN_S) for sock in stalled)
        assert time.monotonic() - start >= 0.8 * timeout_s  # by the deadline, not at once
    finally:
        for sock in stalled:
            sock.close()


def test_a_trickled_head_is_closed_at_the_timeout(server, monkeypatch):
    """A byte every tenth of the timeout: the deadline counts from the connection, not from the
    last byte."""
    timeout_s = 0.5
    monkeypatch.setattr(proxy_limits, "HANDSHAKE_TIMEOUT_S", timeout_s)
    start = time.monotonic()
    with _connect(server, PARTIAL_UPGRADE) as sock:
        closed = False
        while not closed and time.monotonic() - start < timeout_s + MARGIN_S:
            closed = _closed_within(sock, timeout_s / 10)  # the trickle's pace
            if not closed:
                sock.sendall(b"X")
        assert closed


def test_a_kept_alive_connection_gets_the_deadline_for_its_next_head(server, monkeypatch):
    timeout_s = 0.5
    monkeypatch.setattr(proxy_limits, "HANDSHAKE_TIMEOUT_S", timeout_s)
    with _connect(server, GET) as sock:
        assert _response(sock).startswith(b"HTTP/1.1 200")
        assert not _closed_within(sock, 3 * timeout_s)  # idle keep-alive is uvicorn's (30 s here)
        sock.sendall(PARTIAL_UPGRADE)
        assert _closed_within(sock, timeout_s + MARGIN_S)


def test_an_oversized_head_is_closed_before_the_timeout(server, monkeypatch):
    monkeypatch.setattr(proxy_limits, "HANDSHAKE_TIMEOUT_S", 60.0)
    with _connect(server, PARTIAL_UPGRADE) as sock:
        try:
            for i in range(proxy_limits.MAX_HEAD_BYTES // 1000 + 2):
                sock.sendall(b"X-Pad-%d: %s\r\n" % (i, b"a" * 990))
        except (BrokenPipeError, ConnectionResetError):
            pass  # closed while we were still sending
        assert _closed_within(sock, MARGIN_S)


def test_an_upgraded_websocket_outlives_the_head_timeout(server, monkeypatch):
    timeout_s = 0.5
    monkeypatch.setattr(proxy_limits, "HANDSHAKE_TIMEOUT_S", timeout_s)
    with _connect(server, UPGRADE) as sock:
        assert _response(sock).startswith(b"HTTP/1.1 101")
        assert not _closed_within(sock, 3 * timeout_s)


def test_configure_is_idempotent_and_keeps_the_websocket_limits(configured):
    middleware = proxy_limits.configure()  # a second call changes nothing but returns the body limits:
    assert [m.cls for m in middleware] == [proxy_limits.BodyLimits]
    assert not getattr(uvicorn.Config.__init__.__wrapped__, "gapless_limits", False)  # wrapped once
    cfg = uvicorn.Config(_app)
    assert (cfg.ws_max_size, cfg.ws_max_queue, cfg.ws_per_message_deflate) == (
        MAX_WS_MESSAGE_BYTES, proxy_limits.WS_MAX_QUEUE, False)
    assert issubclass(cfg.http, proxy_limits.HeadDeadline)
    explicit = uvicorn.Config(_app, ws_max_size=5, http="h11")  # what the caller passes still wins
    assert (explicit.ws_max_size, explicit.http) == (5, "h11")


# --- request bodies (BodyLimits, the middleware configure() returns) ---------------------------------

SMALL = Route("small", "POST", re.compile(r"/small"), 100, 3)
TEST_ROUTES = (SMALL, Route("other", None, None, 1000, 100))


@pytest.fixture
def body_server(configured):
    """A uvicorn server whose app is BodyLimits around an app that reads the body and answers its
    length; ``reached`` lists the bodies that got through to the app."""
    reached: list[bytes] = []

    async def echo(scope, receive, send):
        if scope["type"] != "http":
            return
        body = b""
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                reached.append("disconnected")
                return
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        reached.append(body)
        out = str(len(body)).encode()
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"%d" % len(out))]})
        await send({"type": "http.response.body", "body": out})

    with _serving(proxy_limits.BodyLimits(echo, TEST_ROUTES)) as port:
        yield port, reached


def _post(path: str, body: bytes = b"", length: int | None = None, chunked: bool = False, token: bool = False) -> bytes:
    head = b"POST %s HTTP/1.1\r\nHost: 127.0.0.1\r\n" % path.encode()
    if token:
        head += b"Authorization: Bearer anything\r\n"  # the proxy cannot tell a good one: the gateway does
    if chunked:
        return head + b"Transfer-Encoding: chunked\r\n\r\n" + (b"%x\r\n%s\r\n" % (len(body), body) if body else b"") + b"0\r\n\r\n"
    return head + b"Content-Length: %d\r\n\r\n" % (len(body) if length is None else length) + body


def _status(sock: socket.socket) -> int:
    return int(_response(sock).split(b" ", 2)[1])


def test_a_body_sent_a_byte_at_a_time_is_answered_408_at_its_deadline_and_others_are_served(body_server, monkeypatch):
    port, reached = body_server
    timeout_s = 0.5
    monkeypatch.setattr(proxy_limits, "BODY_TIMEOUT_S", timeout_s)
    start = time.monotonic()
    with _connect(port, _post("/small", length=50)) as slow:
        slow.sendall(b"x")
        with _connect(port, _post("/small", b"y" * 50)) as ok:
            assert _status(ok) == 200
        status = None
        while status is None and time.monotonic() - start < timeout_s + MARGIN_S:
            if select.select([slow], [], [], timeout_s / 10)[0]:
                status = _status(slow)
            else:
                slow.sendall(b"x")  # a byte every tenth of the deadline: the deadline counts from the head
        assert status == 408 and time.monotonic() - start >= 0.8 * timeout_s
        assert _closed_within(slow, MARGIN_S)
    assert reached == [b"y" * 50]  # the slow body never reached the app


@pytest.mark.parametrize("chunked", [False, True])
def test_a_body_over_its_routes_size_is_answered_413_without_reaching_the_app(body_server, chunked):
    port, reached = body_server
    with _connect(port, _post("/small", b"z" * 101, chunked=chunked)) as sock:
        assert _status(sock) == 413
    with _connect(port, _post("/small", length=10**9)) as sock:  # declared: refused before a byte is read
        assert _status(sock) == 413
    with _connect(port, _post("/small", b"z" * 100, chunked=chunked)) as sock:  # at the cap: whole, replayed
        assert _status(sock) == 200
    with _connect(port, _post("/elsewhere", b"w" * 500, chunked=chunked)) as sock:  # another route's size
        assert _status(sock) == 200
    assert reached == [b"z" * 100, b"w" * 500]


def test_a_route_at_its_budget_is_answered_503_at_once_and_other_routes_are_not(body_server, monkeypatch):
    port, reached = body_server
    monkeypatch.setattr(proxy_limits, "BODY_TIMEOUT_S", 60.0)
    monkeypatch.setattr(proxy_limits, "MAX_BODIES_PER_ADDRESS", 100)
    held = [_connect(port, _post("/small", length=50) + b"x") for _ in range(SMALL.max_in_flight)]
    try:
        with _connect(port, _post("/small", b"y")) as over:
            assert _status(over) == 503
        with _connect(port, _post("/small")) as bodiless:  # nothing to wait for: not held to the budget
            assert _status(bodiless) == 200
        with _connect(port, _post("/elsewhere", b"y")) as other:
            assert _status(other) == 200
        held[0].sendall(b"x" * 49)  # one completes: its place is free again
        assert _status(held[0]) == 200
        with _connect(port, _post("/small", b"y")) as again:
            assert _status(again) == 200
    finally:
        for sock in held:
            sock.close()


def test_an_address_with_bodies_still_arriving_is_answered_503_past_its_share(body_server, monkeypatch):
    port, reached = body_server
    monkeypatch.setattr(proxy_limits, "BODY_TIMEOUT_S", 60.0)
    monkeypatch.setattr(proxy_limits, "MAX_BODIES_PER_ADDRESS", 2)
    held = [_connect(port, _post("/elsewhere", length=50) + b"x") for _ in range(2)]
    try:
        with _connect(port, _post("/elsewhere", b"y")) as over:
            assert _status(over) == 503
        held[1].sendall(b"x" * 49)
        assert _status(held[1]) == 200
        with _connect(port, _post("/elsewhere", b"y")) as again:
            assert _status(again) == 200
    finally:
        for sock in held:
            sock.close()


def test_a_request_with_credentials_streams_past_a_full_anonymous_budget_under_the_same_bounds(body_server,
                                                                                              monkeypatch):
    """Anonymous slow bodies fill the route's budget; a request carrying a credential is not held
    back by them (the gateway checks it before reading its body), and its own body still has the
    route's size and deadline: past them it is answered here, and the app sees a disconnect."""
    port, reached = body_server
    timeout_s = 1.0
    monkeypatch.setattr(proxy_limits, "BODY_TIMEOUT_S", timeout_s)
    monkeypatch.setattr(proxy_limits, "MAX_BODIES_PER_ADDRESS", 100)
    held = [_connect(port, _post("/small", length=50) + b"x") for _ in range(SMALL.max_in_flight)]
    try:
        with _connect(port, _post("/small", b"y")) as anonymous:
            assert _status(anonymous) == 503
        with _connect(port, _post("/small", b"y" * 20, token=True)) as credentialed:
            assert _status(credentialed) == 200
        with _connect(port, _post("/small", b"z" * 101, chunked=True, token=True)) as large:
            assert _status(large) == 413
        start = time.monotonic()
        with _connect(port, _post("/small", length=50, token=True) + b"x") as slow:
            assert _status(slow) == 408 and time.monotonic() - start >= 0.8 * timeout_s
    finally:
        for sock in held:
            sock.close()
    deadline = time.monotonic() + 10
    while len(reached) < 3 and time.monotonic() < deadline:  # the app hears of it after the client does
        time.sleep(0.01)
    assert reached == [b"y" * 20, "disconnected", "disconnected"]


def test_the_gateway_reads_a_body_streamed_to_it_within_the_deadline_and_its_budget(monkeypatch):
    """A body that streams on to the gateway (with a credential; auth mode none checks none) is
    read there within BODY_TIMEOUT_S (408), at most MAX_BODIES_READING at once (503)."""
    from starlette.requests import Request

    from deployments import bodies

    monkeypatch.setattr(bodies, "BODY_TIMEOUT_S", 0.3)

    def request(chunks: list[bytes], stall: bool = False) -> Request:
        async def receive():
            if chunks:
                return {"type": "http.request", "body": chunks.pop(0), "more_body": bool(chunks) or stall}
            await asyncio.Event().wait()  # a client that sends no more
        return Request({"type": "http", "method": "POST", "path": "/", "headers": []}, receive)

    async def read(req: Request, limit: int = 100):
        try:
            return await bodies.read_body(req, limit)
        except bodies.BodyRefused as refused:
            return refused.status, refused.code

    async def go():
        whole = await read(request([b"ab", b"cd"]))
        slow = await read(request([b"ab"], stall=True))
        large = await read(request([b"x" * 60, b"x" * 60]))
        bodies.reading["bodies"] = bodies.MAX_BODIES_READING
        try:
            busy = await read(request([b"ab"]))
        finally:
            bodies.reading["bodies"] = 0
        return whole, slow, large, busy

    whole, slow, large, busy = asyncio.run(go())
    assert whole == b"abcd" and slow == (408, "body_timeout") and large == (413, "body_too_large")
    assert busy == (503, "server_busy") and bodies.reading["bodies"] == 0


# --- every interpreter of the environment has the callback variable (deployments/door_env.py) ----

def _callback_var(environ: dict[str, str], flags: str = "", first: str = "pass") -> str:
    """The variable as a fresh interpreter of this venv sees it (from /, not this checkout)."""
    code = f"{first}; import os; print(os.environ.get({proxy_limits.ENV!r}))"
    return subprocess.run([sys.executable, *filter(None, [flags]), "-c", code], env=environ, cwd="/",
                          capture_output=True, text=True, check=True, timeout=60).stdout.strip()


def test_the_environment_sets_the_proxy_callback_unless_set():
    """This venv's .pth (scripts/install.sh installs it: `python -m deployments.door_env install`)."""
    environ = {k: v for k, v in os.environ.items() if k != proxy_limits.ENV}
    assert _callback_var(environ) == proxy_limits.CALLBACK, "run: python -m deployments.door_env install"
    assert _callback_var({**environ, proxy_limits.ENV: "elsewhere.callback"}) == "elsewhere.callback"


def test_door_env_install_writes_an_effective_pth_once(tmp_path):
    path = door_env.install(tmp_path)
    assert door_env.install(tmp_path) == path and path.read_text() == door_env.PTH_LINE  # one line, once
    environ = {k: v for k, v in os.environ.items() if k != proxy_limits.ENV}
    # -S: not the venv's site-packages (its own .pth); the temporary directory as the one site directory
    load = f"import site; site.addsitedir({str(tmp_path)!r})"
    assert _callback_var(environ, "-S", load) == proxy_limits.CALLBACK
    assert _callback_var({**environ, proxy_limits.ENV: ""}, "-S", load) == ""  # set, even empty: kept
