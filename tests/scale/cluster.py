"""A real two-node Ray cluster on this one machine, and the app deployed across it.

Two raylets (``ray start --head`` and ``ray start --address``), each with its own object store
and a custom resource that names its role: the head node (``head_node``) runs Serve's
controller, the HTTP proxy, the gateway and the LLM; the second node (``model_node``) runs the
STT replicas and the TTS. Every audio chunk a session sends or hears therefore crosses between
two nodes. The app is ``serve_config.yaml`` itself with only the placement changed
(:func:`two_node_config`), deployed with ``serve run`` onto the running cluster.
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import yaml

from tests.e2e.serve_process import PORT, ROOT, ServeProcess, wait_until_down

GCS_PORT = 6391
ADDRESS = f"127.0.0.1:{GCS_PORT}"
# Ray 2.60's `ray start --head` turns token authentication on unless told otherwise, and a raylet
# joining it decides its own mode from its environment and local files (a previous local
# cluster's included): one explicit mode for every process of this loopback-only test cluster.
# A real cluster keeps tokens on (docs/scaling.md).
ENV = {"RAY_ADDRESS": ADDRESS, "RAY_AUTH_MODE": "disabled"}
BIN = Path(sys.executable).parent
APP = "gapless"


# Each node's own metrics: on separate machines every node has its own /tmp/gapless-metrics and its
# scrape target at the same address; here both raylets share one machine, so each gets its own
# directory and port through the environment its workers inherit from `ray start`.
NODE_METRICS = {"head_node": "127.0.0.1:9465", "model_node": "127.0.0.1:9466"}
RAY_METRICS_PORT = {"head_node": 29465, "model_node": 29466}  # Ray's own, as its discovery file lists them


def _ray(*args: str, timeout: float = 180, env: dict | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ, **ENV, **(env or {}))
    return subprocess.run([str(BIN / "ray"), *args], capture_output=True, text=True, timeout=timeout, env=env)


def node_env(workdir: Path, role: str) -> dict[str, str]:
    metrics_dir = workdir / f"metrics-{role}"
    metrics_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    return {"PROMETHEUS_MULTIPROC_DIR": str(metrics_dir), "GAPLESS_NODE_METRICS": NODE_METRICS[role]}


def two_node_config(out: Path, stt_replicas: int = 2) -> Path:
    """serve_config.yaml with the model replicas placed on the second node; nothing else changed."""
    cfg = yaml.safe_load((ROOT / "serve_config.yaml").read_text())
    app = cfg["applications"][0]
    placement = {
        "Gateway": {"num_cpus": 0.2, "resources": {"head_node": 0.01}},
        "LLM": {"num_cpus": 0.5, "resources": {"head_node": 0.01}},
        "STT": {"num_cpus": 0.5, "resources": {"model_node": 0.01}},
        "TTS": {"num_cpus": 0.5, "resources": {"model_node": 0.01}},
    }
    app["deployments"] = [
        {"name": name, "ray_actor_options": opts, **({"num_replicas": stt_replicas} if name == "STT" else {})}
        for name, opts in placement.items()
    ]
    del app["runtime_env"]["env_vars"]["PROMETHEUS_MULTIPROC_DIR"]  # each node's own (node_env)
    out.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return out


class TwoNodeCluster:
    """``start()`` brings up both raylets and deploys the app; ``stop()`` ends all of it."""

    def __init__(self, workdir: Path, stt_replicas: int = 2):
        self.workdir = workdir
        self.stt_replicas = stt_replicas
        self.serve: ServeProcess | None = None

    def start(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        wait_until_down()  # an earlier test's server may still be letting go of the port
        common = ["--disable-usage-stats", "--object-store-memory", str(300 * 2**20)]
        head = _ray("start", "--head", f"--port={GCS_PORT}", "--num-cpus=1", "--resources", '{"head_node": 1}',
                    "--include-dashboard=true", f"--metrics-export-port={RAY_METRICS_PORT['head_node']}", *common,
                    env=node_env(self.workdir, "head_node"))
        if head.returncode != 0:
            raise RuntimeError(f"ray start --head failed: {head.stdout[-2000:]}{head.stderr[-2000:]}")
        worker = _ray("start", f"--address={ADDRESS}", "--num-cpus=2", "--resources", '{"model_node": 1}',
                      f"--metrics-export-port={RAY_METRICS_PORT['model_node']}", *common,
                      env=node_env(self.workdir, "model_node"))
        if worker.returncode != 0:
            self.stop()
            raise RuntimeError(f"ray start --address failed: {worker.stdout[-2000:]}{worker.stderr[-2000:]}")
        config = two_node_config(self.workdir / "serve_config.two_nodes.yaml", self.stt_replicas)
        self.serve = ServeProcess(str(config), log_path=str(ROOT / "out" / "serve-two-nodes.log"),
                                  env=ENV)
        try:
            self.serve.start()
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        if self.serve is not None:
            self.serve.stop()  # SIGTERM to serve run, then `ray stop --force` (both raylets)
            self.serve = None
        else:
            _ray("stop", "--force")

    # ------------------------------------------------------------------ what runs where
    def nodes(self) -> dict[str, str]:
        """node id -> role ("head_node" / "model_node"), from Ray's state API."""
        rows = json.loads(_ray("list", "nodes", "--format=json", "--detail").stdout)
        roles = {}
        for n in rows:
            if n["state"] != "ALIVE":
                continue
            res = n.get("resources_total", {})
            roles[n["node_id"]] = "model_node" if "model_node" in res else "head_node" if "head_node" in res else "?"
        return roles

    def replicas(self, deployment: str) -> list[dict]:
        """The live replicas of a deployment: {"unique_id", "pid", "node_id"} each."""
        out = _ray("list", "actors", "--format=json", "--detail", "--limit=1000", "--filter", "state=ALIVE")
        found = []
        for a in json.loads(out.stdout):
            name = a.get("name") or ""
            m = re.fullmatch(rf"SERVE_REPLICA::{APP}#{deployment}#(\w+)", name)
            if m:
                found.append({"unique_id": m.group(1), "pid": a["pid"], "node_id": a["node_id"]})
        return found

    @staticmethod
    def kill(pid: int) -> None:
        """kill -9: the replica process dies at once, with no clean-up of any kind."""
        os.kill(pid, signal.SIGKILL)


def scrape(role: str | None = None) -> str:
    """A node's scrape target (``role``: head_node, model_node), or the gateway's /metrics."""
    url = f"http://{NODE_METRICS[role]}/metrics" if role else f"http://127.0.0.1:{PORT}/metrics"
    return urllib.request.urlopen(url, timeout=10).read().decode()


def metric(name: str) -> dict[str, float]:
    """One counter family summed over both nodes' scrape targets: label text -> value."""
    out: dict[str, float] = {}
    for role in NODE_METRICS:
        for m in re.finditer(rf"^{re.escape(name)}(\{{[^}}]*\}})? (\S+)$", scrape(role), flags=re.M):
            out[m.group(1) or ""] = out.get(m.group(1) or "", 0.0) + float(m.group(2))
    return out


def by_replica(name: str) -> dict[str, float]:
    """A per-replica counter (label ``replica``) as replica unique id -> value."""
    out = {}
    for labels, value in metric(name).items():
        m = re.search(r'replica="([^"]*)"', labels)
        if m:
            out[m.group(1)] = out.get(m.group(1), 0.0) + value
    return out
