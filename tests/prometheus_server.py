"""A real Prometheus (Debian's package, installed by scripts/install.sh --system) for the tests
that check what it scrapes: started on a config, ready once /-/ready answers, stopped after."""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

PROM_PORT = 9391
GRAFANA = Path(__file__).resolve().parents[1] / "grafana"


@contextlib.contextmanager
def prometheus(tmp_path: Path, config: str):
    """Prometheus on ``config`` (YAML text; alert_rules.yml beside it), scraping every second."""
    binary = shutil.which("prometheus")
    if binary is None:
        if os.environ.get("CI"):
            pytest.fail("prometheus is not installed: `bash scripts/install.sh --system` installs it")
        pytest.skip("prometheus not installed (apt-get install prometheus)")
    cfg = tmp_path / "prometheus.yml"
    cfg.write_text(config.replace("scrape_interval: 5s", "scrape_interval: 1s"))
    shutil.copy(GRAFANA / "alert_rules.yml", tmp_path / "alert_rules.yml")
    proc = subprocess.Popen(
        [binary, f"--config.file={cfg}", f"--storage.tsdb.path={tmp_path / 'data'}",
         f"--web.listen-address=127.0.0.1:{PROM_PORT}"],
        stdout=subprocess.DEVNULL, stderr=open(tmp_path / "prometheus.log", "w"),
    )
    try:
        for _ in range(60):
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{PROM_PORT}/-/ready", timeout=2)
                break
            except OSError:
                time.sleep(0.5)
        yield proc
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def query(expr: str) -> list:
    url = f"http://127.0.0.1:{PROM_PORT}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    with urllib.request.urlopen(url, timeout=10) as r:
        body = json.loads(r.read())
    assert body["status"] == "success", body
    return body["data"]["result"]


def api(path: str) -> dict:
    with urllib.request.urlopen(f"http://127.0.0.1:{PROM_PORT}/api/v1/{path}", timeout=10) as r:
        return json.loads(r.read())["data"]
