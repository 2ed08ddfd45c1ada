"""A killed process's live-sum gauges leave the node's /metrics sum (pipeline/metrics.py): two
processes record sessions into one multiprocess directory, one is killed with SIGKILL."""
from __future__ import annotations

import os
import signal
import subprocess
import sys

from prometheus_client.parser import text_string_to_metric_families

from pipeline import metrics

CHILD = """
import sys
from pipeline import metrics
metrics.SESSIONS_ACTIVE.set(int(sys.argv[1]))
print("set", flush=True)
sys.stdin.read()
"""


def _sessions() -> float:
    families = text_string_to_metric_families(metrics.exposition().decode())
    return sum(s.value for f in families if f.name == "voice_sessions_active" for s in f.samples)


def test_a_killed_process_leaves_the_live_sum(tmp_path, monkeypatch):
    env = dict(os.environ, PROMETHEUS_MULTIPROC_DIR=str(tmp_path))
    children = [subprocess.Popen([sys.executable, "-c", CHILD, str(n)], env=env, stdin=subprocess.PIPE,
                                 stdout=subprocess.PIPE, text=True) for n in (3, 4)]
    try:
        for child in children:
            assert child.stdout.readline().strip() == "set"
        monkeypatch.setenv(metrics.MULTIPROC_ENV, str(tmp_path))
        assert _sessions() == 7
        children[0].send_signal(signal.SIGKILL)
        children[0].wait(10)
        assert _sessions() == 4  # the killed one's 3 sessions are gone; the live one's stay
        assert not any(str(children[0].pid) in name for name in os.listdir(tmp_path) if "live" in name)
    finally:
        for child in children:
            child.kill()
            child.wait(10)


HOLDER = """
import sys
from pipeline import metrics
print("trying", flush=True)
metrics.hold_node_port(sys.argv[1], ("127.0.0.1", int(sys.argv[2])), retry_s=0.1)
print("listening", flush=True)
sys.stdin.read()
"""


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _scrape_sessions(port: int) -> float:
    import urllib.request

    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    families = text_string_to_metric_families(text)
    return sum(s.value for f in families if f.name == "voice_sessions_active" for s in f.samples)


def _listening_within(proc: subprocess.Popen, seconds: float) -> bool:
    import select

    readable, _, _ = select.select([proc.stdout], [], [], seconds)
    return bool(readable) and proc.stdout.readline().strip() == "listening"


def test_one_process_of_the_node_serves_its_metrics_and_another_takes_over(tmp_path):
    """Two replica processes contend for the node's metrics port: one listens and serves every
    process's metrics of the node's directory; killed, the other takes the port over."""
    env = dict(os.environ, PROMETHEUS_MULTIPROC_DIR=str(tmp_path))
    port = _free_port()
    recorder = subprocess.Popen([sys.executable, "-c", CHILD, "3"], env=env, stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, text=True)
    holders = []
    try:
        assert recorder.stdout.readline().strip() == "set"
        for _ in range(2):
            holders.append(subprocess.Popen([sys.executable, "-c", HOLDER, str(tmp_path), str(port)], env=env,
                                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True))
            assert holders[-1].stdout.readline().strip() == "trying"
            assert _listening_within(holders[-1], 30 if len(holders) == 1 else 1.0) is (len(holders) == 1)
            # the second tried ten times in that second: the port is the first one's
        assert _scrape_sessions(port) == 3  # another process's gauge, served by the first holder
        holders[0].send_signal(signal.SIGKILL)
        holders[0].wait(10)
        assert _listening_within(holders[1], 30)
        assert _scrape_sessions(port) == 3
    finally:
        for proc in [recorder, *holders]:
            proc.kill()
            proc.wait(10)


def test_node_metrics_address():
    assert metrics.node_metrics_address("0.0.0.0:9464") == ("0.0.0.0", 9464)
    assert metrics.node_metrics_address("[::]:9000") == ("::", 9000)
    assert metrics.node_metrics_address(" OFF ") is None
    for bad in ("9464", "host:", "host:70000", "host:port"):
        try:
            metrics.node_metrics_address(bad)
        except ValueError as exc:
            assert "GAPLESS_NODE_METRICS" in str(exc)
        else:
            raise AssertionError(bad)


def test_gpu_utilisation_is_absent_without_a_gpu():
    """No NVIDIA driver here: no NVML device, and so no voice_gpu_utilization_ratio series at all
    (absent, not 0: a dashboard tells "no GPU" from "an idle GPU")."""
    from pipeline import metrics

    assert metrics.nvml_device(0) is None
    assert "voice_gpu_utilization_ratio{" not in metrics.exposition().decode()
