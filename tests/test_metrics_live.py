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
