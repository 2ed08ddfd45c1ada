"""load/gpu_serve.sh, the served GPU run: the config it serves, and the whole script dry-run on this
CPU with tiny shapes against a real `serve run` (every step, the summary, the tables), as CI runs it.

The dry run starts its own app on port 8000, so it sits after the end-to-end packages (tests/e2e*,
collected first), whose servers are down by then."""
from __future__ import annotations

import json
import os
import subprocess
import tarfile
from pathlib import Path

import pytest

from deployments.app import AppArgs, configs
from load.gpu_serve import served_config

ROOT = Path(__file__).resolve().parents[1]
# warm_start, the cold start's own step again (warming nothing on a CPU), runs in the GPU run only
STEPS = ("install", "cold_start", "gaps", "cost_v1_2", "turn_taking", "cost_realtime_2", "metrics")


@pytest.fixture
def token(monkeypatch):
    monkeypatch.setenv("GAPLESS_TOKENS", "a-throw-away-token-for-the-run")


def test_the_gpu_run_serves_the_gpu_config_at_full_size(token):
    cfg = served_config(dry_run=False)
    app = cfg["applications"][0]
    built = configs(AppArgs(**app["args"]))
    assert (built["stt"].profile, built["llm"].profile, built["tts"].profile) == ("full", "full", "full")
    assert built["tts"].frame_graphs and built["stt"].num_slots == 64
    assert cfg["http_options"]["host"] == "127.0.0.1" and app["args"]["auth"]["mode"] == "token"
    assert app["runtime_env"]["env_vars"]["GAPLESS_NODE_METRICS"].startswith("127.0.0.1:")
    gpu_shares = {d["name"]: d["ray_actor_options"].get("num_gpus", 0) for d in app["deployments"]}
    tts = next(d for d in app["deployments"] if d["name"] == "TTS")
    # the model replicas it can reach fit one GPU
    assert gpu_shares["STT"] + gpu_shares["LLM"] + tts["autoscaling_config"]["max_replicas"] * gpu_shares["TTS"] <= 1


def test_the_dry_run_config_keeps_the_gpu_sessions_on_tiny_engines(token):
    cfg = served_config(dry_run=True)
    args = cfg["applications"][0]["args"]
    built = configs(AppArgs(**args))
    assert built["tts"].profile == "tiny" and built["tts"].device == "cpu" and not built["tts"].frame_graphs
    # the GPU config's shape, placed on a node Ray is told has one GPU: replicas, gateways, autoscaling,
    # GPU shares; only the CPU shares (the replicas' torch threads) are the tiny config's
    gpu = served_config(dry_run=False)["applications"][0]["deployments"]
    dry = cfg["applications"][0]["deployments"]

    def shape(deployments: list[dict]) -> list[dict]:
        return [{**d, "ray_actor_options": {k: v for k, v in d["ray_actor_options"].items() if k != "num_cpus"}}
                for d in deployments]

    assert shape(dry) == shape(gpu)
    gateways = next(d for d in dry if d["name"] == "Gateway")
    assert gateways["num_replicas"] == 4 and gateways["ray_actor_options"]["num_cpus"] < 1
    assert sum(d["ray_actor_options"].get("num_gpus", 0) for d in dry) > 0
    assert args["session"]["max_sessions_per_client"] >= 64 and args["auth"]["mode"] == "token"


def test_dry_run_runs_every_step_against_a_real_serve_run(tmp_path):
    out = tmp_path / "gpu_serve"
    env = {**os.environ, "OUT": str(out), "CARRY": os.environ.get("GAPLESS_TEST_CARRY", str(tmp_path / "carry"))}
    proc = subprocess.run(["bash", "load/gpu_serve.sh", "--dry-run"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=1500)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    summary = json.loads((out / "summary.json").read_text())
    assert set(STEPS) <= set(summary)
    assert {name: s["rc"] for name, s in summary.items()} == dict.fromkeys(summary, 0)
    facts = dict(line.split("\t", 1) for line in (out / "facts.tsv").read_text().splitlines())
    assert float(facts["cold_start_s"]) > 0 and "warm_start_s" not in facts
    after = json.loads(facts["metrics_after_load"])
    # the series of every model deployment are there; whether they stay at 0 is the GPU run's to show
    # (the dry run serves the tiny engines uncompiled, so its count is 0 whatever the code does)
    assert set(after["compiles_after_warmup"]) >= {"stt", "llm", "tts"}
    assert after["chunk_gaps"]["all"] > 0  # the gateways saw the load's replies
    assert after["server_ms"]["voice_to_voice v1"] > 0  # the hands-free turns, by the server's clock
    assert after["gpu_utilization"] == {}  # no GPU in the dry run: the series is absent
    for protocol in ("v1", "realtime"):
        level = summary[f"cost_{protocol}_2"]["result"]["levels"][0]
        assert level["sessions"] == 2
        assert level["turns"] > 0 and level["cpu_s_per_conversation_s"]["total"] > 0
    assert summary["gaps"]["result"]["turns"] == 2
    assert summary["turn_taking"]["result"]["turn_test"]["voice_to_voice_ms"]["n"] > 0
    tables = (out / "tables.md").read_text()
    for section in ("## Start", "## One conversation", "## N conversations", "## Voice to voice", "## After the load"):
        assert section in tables
    with tarfile.open(out / "logs.tar.gz") as tar:
        assert "logs/serve.log" in tar.getnames()
    assert len([p for p in out.rglob("*") if p.is_file()]) <= 8  # what one device call sends back
