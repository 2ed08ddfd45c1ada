"""The node's scrape target (pipeline/metrics.py, NodeExporter) cannot be held by one client: a
connection lives at most its timeout, however it trickles; at most max_threads connections are
served at once and one more is closed as it arrives; off loopback a scrape needs a bearer token,
and with none set the exporter does not listen. Real sockets on 127.0.0.1; every wait is bounded."""
from __future__ import annotations

import http.client
import logging
import select
import socket
import threading
import time

import pytest
from prometheus_client import CollectorRegistry, Gauge

from pipeline import metrics

TOKEN = "Zq3v8JmT1xKp0sWd7LbN4yRc"  # 24 characters, well over auth's entropy floor
MARGIN_S = 3.0  # scheduling slack on a loaded 2-core machine


def _registry() -> CollectorRegistry:
    registry = CollectorRegistry()
    Gauge("gapless_exporter_test", "A gauge the scrape must show.", registry=registry).set(7)
    return registry


@pytest.fixture
def exporter():
    """exporter(**kwargs): a NodeExporter on a free loopback port, serving; shut down afterwards."""
    servers = []

    def start(**kwargs) -> metrics.NodeExporter:
        server = metrics.NodeExporter(("127.0.0.1", 0), _registry(), **kwargs)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


def _scrape(port: int, authorization: str | None = None) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request("GET", "/metrics", headers={"Authorization": authorization} if authorization else {})
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


def _silent(port: int) -> socket.socket:
    """A client that connects and sends nothing."""
    return socket.create_connection(("127.0.0.1", port), timeout=10)


def _closed_within(sock: socket.socket, seconds: float) -> bool:
    """Whether the server closes ``sock`` within ``seconds`` (recv sees the end, or a reset)."""
    readable, _, _ = select.select([sock], [], [], seconds)
    if not readable:
        return False
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


def _still_open(sock: socket.socket) -> bool:
    readable, _, _ = select.select([sock], [], [], 0)
    return not readable


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_with_tokens_a_scrape_needs_one(exporter):
    """Token mode (what an exporter off loopback runs), forced here on 127.0.0.1."""
    port = exporter(tokens=(TOKEN,)).server_address[1]
    for header in (None, "Bearer", "Bearer wrong-" + TOKEN, f"Basic {TOKEN}", f"Bearer {TOKEN[:-1]}"):
        status, body = _scrape(port, header)
        assert status == 401 and b"gapless_exporter_test" not in body, header
    status, body = _scrape(port, f"Bearer {TOKEN}")
    assert status == 200 and b"gapless_exporter_test 7.0" in body


def test_on_loopback_the_node_port_serves_without_a_token(tmp_path, monkeypatch):
    """hold_node_port on the default (loopback) address: no token asked, even with tokens set."""
    monkeypatch.setenv(metrics.NODE_TOKENS_ENV, TOKEN)
    server = metrics.hold_node_port(str(tmp_path), ("127.0.0.1", _free_port()), retry_s=0.1)
    try:
        assert server is not None
        status, _ = _scrape(server.server_address[1])
        assert status == 200
    finally:
        if server is not None:
            server.shutdown()
            server.server_close()


def test_off_loopback_without_a_token_the_node_port_is_not_opened(tmp_path, monkeypatch, caplog):
    monkeypatch.delenv(metrics.NODE_TOKENS_ENV, raising=False)
    port = _free_port()
    with caplog.at_level(logging.ERROR, logger=metrics.__name__):
        server = metrics.hold_node_port(str(tmp_path), ("0.0.0.0", port), retry_s=0.1)
    if server is not None:  # the code under test regressed: do not leave it listening
        server.shutdown()
        server.server_close()
    assert server is None
    assert any(metrics.NODE_TOKENS_ENV in r.getMessage() for r in caplog.records)
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port), timeout=5).close()


def test_is_loopback():
    for host in ("127.0.0.1", "127.0.0.53", "::1", "localhost", "LOCALHOST"):
        assert metrics.is_loopback(host), host
    for host in ("0.0.0.0", "::", "", "192.0.2.2", "fd00::2", "metrics.example.com"):
        assert not metrics.is_loopback(host), host


def test_exporter_tokens():
    assert metrics.exporter_tokens("127.0.0.1", {metrics.NODE_TOKENS_ENV: TOKEN}) == ()
    assert metrics.exporter_tokens("0.0.0.0", {metrics.NODE_TOKENS_ENV: f" {TOKEN}, other-{TOKEN} "}) == (
        TOKEN, f"other-{TOKEN}")
    for environ in ({}, {metrics.NODE_TOKENS_ENV: " "}, {metrics.NODE_TOKENS_ENV: "x" * 32}):
        with pytest.raises(ValueError):
            metrics.exporter_tokens("0.0.0.0", environ)


def test_a_silent_client_is_cut_at_the_timeout_while_a_scrape_answers(exporter):
    timeout_s = 1.0
    port = exporter(timeout_s=timeout_s, max_threads=2).server_address[1]
    start = time.monotonic()
    with _silent(port) as silent:
        status, _ = _scrape(port)
        assert status == 200 and _still_open(silent)
        assert _closed_within(silent, timeout_s + MARGIN_S)
        assert time.monotonic() - start >= 0.8 * timeout_s  # cut by the timeout, not at once


def test_a_trickling_client_is_cut_at_the_timeout(exporter):
    """A byte every fifth of the timeout keeps every single read short: the connection's whole
    life is bounded all the same."""
    timeout_s = 1.0
    port = exporter(timeout_s=timeout_s).server_address[1]
    start = time.monotonic()
    with _silent(port) as client:
        client.sendall(b"GET /metrics HTTP/1.1\r\nX-Slow: ")
        closed = False
        while not closed and time.monotonic() - start < timeout_s + MARGIN_S:
            closed = _closed_within(client, timeout_s / 5)  # the pace of the trickle
            if not closed:
                client.sendall(b"a")
        assert closed
        assert time.monotonic() - start >= 0.8 * timeout_s


def _handler_threads() -> int:
    return sum("process_request_thread" in t.name for t in threading.enumerate())


def _scrape_status(port: int) -> int | None:
    """The status of one scrape; None where the connection is closed unanswered."""
    try:
        return _scrape(port)[0]
    except (http.client.HTTPException, OSError):
        return None


def test_more_slow_clients_than_threads_do_not_block_a_scrape(exporter):
    """With every thread held by a silent client, more clients (a scrape too) are closed at once,
    never queued; once the held ones reach the timeout, a scrape is answered."""
    timeout_s, threads = 2.0, 2
    port = exporter(timeout_s=timeout_s, max_threads=threads).server_address[1]
    start = time.monotonic()
    held = [_silent(port) for _ in range(threads)]
    extra = [_silent(port) for _ in range(threads)]
    try:
        for sock in extra:
            assert _closed_within(sock, timeout_s / 2)
        refused_at = time.monotonic()
        assert _scrape_status(port) is None and time.monotonic() - refused_at < timeout_s / 2
        assert all(_still_open(sock) for sock in held) and _handler_threads() <= threads
        answered = None
        while answered != 200 and time.monotonic() - start < timeout_s + MARGIN_S:
            answered = _scrape_status(port)
            if answered is None:
                time.sleep(0.05)  # poll interval, under the deadline above
        assert answered == 200
        assert all(_closed_within(sock, MARGIN_S) for sock in held)
    finally:
        for sock in held + extra:
            sock.close()
