"""The two entry points (serve_config.yaml, serve_config.gpu.yaml) are valid Serve configs whose
app args build engine configurations; a config with a typo is refused before anything starts."""
from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from ray.serve.schema import ServeDeploySchema

from deployments.app import AppArgs, configs

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _a_token(monkeypatch):
    """serve_config.gpu.yaml has auth on and needs a token to build (tests/test_auth.py checks that)."""
    monkeypatch.setenv("GAPLESS_TOKENS", "a-token-for-the-gpu-config")


@pytest.mark.parametrize("name", ["serve_config.yaml", "serve_config.gpu.yaml"])
def test_serve_config_is_valid(name):
    cfg = yaml.safe_load((ROOT / name).read_text())
    schema = ServeDeploySchema.model_validate(cfg)
    app = schema.applications[0]
    built = configs(AppArgs(**app.args))
    assert set(built) == {"stt", "llm", "tts", "session", "auth"}
    deployments = {d.name: d for d in app.deployments}
    assert set(deployments) == {"Gateway", "STT", "LLM", "TTS"}
    # STT streams are hash-routed: a fixed replica count, never autoscaled (a ring change moves streams)
    raw_stt = next(d for d in cfg["applications"][0]["deployments"] if d["name"] == "STT")
    assert "autoscaling_config" not in raw_stt and raw_stt["num_replicas"] >= 1
    assert app.runtime_env["env_vars"]["GAPLESS_COMPILE_CACHE"]


def test_gpu_config_autoscales_tts_within_its_slots():
    cfg = yaml.safe_load((ROOT / "serve_config.gpu.yaml").read_text())
    app = cfg["applications"][0]
    tts = next(d for d in app["deployments"] if d["name"] == "TTS")
    slots = configs(AppArgs(**app["args"]))["tts"].num_slots
    auto = tts["autoscaling_config"]
    assert auto["min_replicas"] >= 1 and auto["max_replicas"] > auto["min_replicas"]
    assert auto["target_ongoing_requests"] <= slots <= tts["max_ongoing_requests"]


def test_unknown_settings_are_refused():
    with pytest.raises(ValueError, match="unknown STTConfig settings"):
        configs(AppArgs(stt={"num_slot": 4}))
    with pytest.raises(ValueError, match="unknown session settings"):
        configs(AppArgs(session={"idle_timeout": 3}))


@pytest.mark.parametrize("name", ["serve_config.yaml", "serve_config.gpu.yaml"])
def test_served_profiles_are_hands_free(name):
    cfg = yaml.safe_load((ROOT / name).read_text())
    session = configs(AppArgs(**cfg["applications"][0]["args"]))["session"]
    assert session["turn_detection"] == "vad" and session["barge_in"] == "vad"


def test_bad_turn_taking_settings_stop_the_start():
    for bad in ({"turn_detection": "push"}, {"barge_in": "loud"}, {"vad_threshold": 0}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            configs(AppArgs(session=bad, auth={"mode": "none"}))


def test_full_profile_is_random_weights_at_real_shapes():
    """profile: full (load/gpu_check.sh): every engine at its real model's shape, no checkpoint."""
    built = configs(AppArgs(profile="full", device="cuda", auth={"mode": "none"}))
    stt, llm, tts = built["stt"], built["llm"], built["tts"]
    assert (stt.profile, stt.model, stt.dtype) == ("full", None, "bfloat16")
    assert llm.is_tiny and (llm.tiny_layers, llm.tiny_hidden, llm.tiny_intermediate) == (24, 896, 4864)
    assert (tts.profile, tts.device) == ("full", "cuda")
