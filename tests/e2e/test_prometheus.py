"""Metrics as a user sees them: a real Prometheus scrapes the running app, and every metric the
dashboard and alert rules query exists in the app's scrape output."""
from __future__ import annotations

import asyncio
import json
import re
import time
import urllib.request

import pytest

from load.client import Conversation
from tests.e2e.serve_process import PORT, URL
from tests.prometheus_server import GRAFANA, PROM_PORT, prometheus as run_prometheus, query


def scrape() -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{PORT}/metrics", timeout=10) as r:
        assert r.status == 200
        return r.read().decode()


def queried_metric_names() -> set[str]:
    exprs = [t["expr"] for p in json.loads((GRAFANA / "dashboards" / "gapless.json").read_text())["panels"]
             for t in p["targets"]]
    exprs += re.findall(r"expr:\s*(.+)", (GRAFANA / "alert_rules.yml").read_text())
    return {n for e in exprs for n in re.findall(r"\bvoice_[a-z_]+", e)}


# Queried but absent by design on a machine without a GPU: the model replicas export them only
# where CUDA is in use (voice_gpu_memory_bytes) or NVML finds a GPU (voice_gpu_utilization_ratio).
ABSENT_WITHOUT_GPU = {"voice_gpu_utilization_ratio", "voice_gpu_memory_bytes"}


def test_every_queried_metric_is_exported(server):
    asyncio.run(_short_conversation())
    text = scrape()
    exported = set(re.findall(r"^(voice_[a-z_]+)(?:\{|\s)", text, flags=re.M))
    names = queried_metric_names()
    assert len(names) >= 10
    missing = sorted(names - exported - ABSENT_WITHOUT_GPU)
    assert not missing, f"dashboard/alerts query metrics the app does not export: {missing}"
    # the compile counter is there for every model deployment, at 0
    for dep in ("stt", "llm", "tts"):
        assert re.search(rf'^voice_compiles_after_warmup_total\{{deployment="{dep}"\}} 0\.0$', text, flags=re.M), dep


async def _short_conversation():
    async with Conversation(URL) as conv:
        await conv.say_text("Hello there, how are you?")
        await conv.say_text("Tell me something.")


@pytest.fixture
def prometheus(tmp_path):
    with run_prometheus(tmp_path, (GRAFANA / "prometheus.yml").read_text()) as proc:
        yield proc


def test_prometheus_scrapes_slo_histograms(server, prometheus):
    asyncio.run(_short_conversation())
    deadline = time.monotonic() + 90
    gaps = ttfa = []
    while time.monotonic() < deadline:
        gaps = query("sum(voice_audio_chunk_gap_seconds_count)")
        ttfa = query("sum(voice_time_to_first_audio_seconds_count)")
        if gaps and ttfa and float(gaps[0]["value"][1]) > 0 and float(ttfa[0]["value"][1]) > 0:
            break
        time.sleep(1)
    assert gaps and float(gaps[0]["value"][1]) > 0
    assert ttfa and float(ttfa[0]["value"][1]) >= 2
    compiles = query("voice_compiles_after_warmup_total")
    assert sorted(r["metric"]["deployment"] for r in compiles) == ["llm", "stt", "tts"]
    assert all(float(r["value"][1]) == 0 for r in compiles)
    # the alert rules load and evaluate without error
    deadline = time.monotonic() + 30
    while True:
        with urllib.request.urlopen(f"http://127.0.0.1:{PROM_PORT}/api/v1/rules", timeout=10) as r:
            rules = [rule for g in json.loads(r.read())["data"]["groups"] for rule in g["rules"]]
        if all(r["health"] == "ok" for r in rules) or time.monotonic() > deadline:
            break
        time.sleep(1)
    assert {r["name"] for r in rules} == {
        # the chunk-gap SLO's error ratios (recording rules), then the alerts
        "slo:chunk_gap_errors:ratio_rate5m", "slo:chunk_gap_errors:ratio_rate30m",
        "slo:chunk_gap_errors:ratio_rate1h", "slo:chunk_gap_errors:ratio_rate6h",
        "AudioChunkGapBudgetBurn", "AudioChunkGapBudgetBurnSlow", "PhoneDeadAirOver500ms", "CompilesAfterWarmup",
        "UnseenShapesAfterWarmup", "TimeToFirstAudioP95High", "VoiceToVoiceP95High", "ErrorRatioHigh",
        "DeadAirByCause", "TargetDown"}
    assert all(r["health"] == "ok" for r in rules), rules
