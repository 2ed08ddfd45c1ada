"""Start and stop the real app (`serve run serve_config.yaml`) for end-to-end tests."""
from __future__ import annotations

import os
import signal
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PORT = 8000
HANDS_FREE_URL = f"ws://127.0.0.1:{PORT}/v1/conversation"  # the served default: turns by VAD + Smart Turn
# Push-to-talk sessions (a client option, docs/protocol.md): most tests speak synthetic audio,
# which no VAD calls speech, and end each turn with turn.end.
URL = f"{HANDS_FREE_URL}?turn_detection=manual"
REALTIME_URL = f"ws://127.0.0.1:{PORT}/v1/realtime"  # the OpenAI Realtime protocol (docs/realtime.md)


def healthz(scheme: str = "http") -> int | None:
    """/healthz's status, None when nothing answers (over TLS: any certificate, this only probes)."""
    context = ssl._create_unverified_context() if scheme == "https" else None
    try:
        with urllib.request.urlopen(f"{scheme}://127.0.0.1:{PORT}/healthz", timeout=5, context=context) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except OSError:
        return None


def wait_until_down(timeout: float = 60) -> None:
    """Return once nothing answers on the port: processes killed by ``ray stop --force`` release
    it a moment after the command returns, and the next test's server needs it."""
    deadline = time.monotonic() + timeout
    while healthz() is not None or healthz("https") is not None:
        if time.monotonic() > deadline:
            raise RuntimeError(f"something still answers on port {PORT} {timeout} s after stopping")
        time.sleep(0.2)


class ServeProcess:
    """``serve run CONFIG`` in its own process group; stopped with SIGTERM (SIGINT hangs)."""

    def __init__(self, config: str = "serve_config.yaml", log_path: str | None = None, env: dict | None = None,
                 scheme: str = "http"):
        self.config = config
        self.scheme = scheme  # "https": the config serves TLS (http_options ssl_certfile / ssl_keyfile)
        self.env = env or {}  # e.g. RAY_ADDRESS: deploy onto a cluster started beforehand
        self.log_path = log_path or str(ROOT / "out" / "serve-test.log")
        self.proc: subprocess.Popen | None = None
        self.seen_503 = False
        self.startup_s: float | None = None

    def start(self, timeout: float = 600) -> None:
        if healthz() is not None or healthz("https") is not None:
            raise RuntimeError(f"something already answers on port {PORT}; stop it first")
        Path(self.log_path).parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "w")
        # Plain `serve run`, as a user runs it: the proxy's limits (deployments/proxy_limits.py) come
        # from the environment's .pth (scripts/install.sh), so this process's own setting is not passed on.
        env = dict(os.environ, RAY_DEDUP_LOGS="0", PYTHONUNBUFFERED="1", **self.env)
        env.pop("RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH", None)
        serve = str(Path(sys.executable).parent / "serve")
        t0 = time.monotonic()
        self.proc = subprocess.Popen(
            [serve, "run", self.config], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
            env=env, start_new_session=True,
        )
        while time.monotonic() - t0 < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"serve run exited with {self.proc.returncode}; see {self.log_path}")
            status = healthz(self.scheme)
            if status == 503:
                self.seen_503 = True
            if status == 200:
                self.startup_s = time.monotonic() - t0
                return
            time.sleep(1)
        self.stop()
        raise TimeoutError(f"app not healthy after {timeout} s; see {self.log_path}")

    def stop(self) -> None:
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(timeout=60)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        subprocess.run([str(Path(sys.executable).parent / "ray"), "stop", "--force"],
                       capture_output=True, timeout=120)
        self.proc = None
        wait_until_down()
