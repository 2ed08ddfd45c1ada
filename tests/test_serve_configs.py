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
    assert set(built) == {"stt", "llm", "tts", "tts_second", "session", "auth", "phone", "webrtc"}
    assert {built[e].profile for e in ("stt", "llm", "tts")} == {app.args["profile"]}  # one profile, every engine
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
    assert llm.profile == "full" and (llm.tiny_layers, llm.tiny_hidden, llm.tiny_intermediate) == (24, 896, 4864)
    assert (tts.profile, tts.device) == ("full", "cuda")


@pytest.mark.parametrize("profile", ["tiny", "full", "real"])
def test_every_engine_config_is_built_from_the_profile(profile):
    """One vocabulary: the app's profile picks each engine config's tiny()/full()/real() constructor,
    and each config says which profile it was built for."""
    from pipeline.llm.config import LLMConfig
    from pipeline.stt.config import STTConfig
    from pipeline.tts.config import TTSConfig

    built = configs(AppArgs(profile=profile, device="cpu", auth={"mode": "none"}))
    for name, cls in (("stt", STTConfig), ("llm", LLMConfig), ("tts", TTSConfig)):
        want = getattr(cls, profile)(device="cpu")
        assert built[name] == want and built[name].profile == profile, name


@pytest.mark.parametrize("name", ["STTConfig", "LLMConfig", "TTSConfig"])
def test_an_unknown_profile_is_refused(name):
    from pipeline.llm.config import LLMConfig
    from pipeline.stt.config import STTConfig
    from pipeline.tts.config import TTSConfig

    cls = {"STTConfig": STTConfig, "LLMConfig": LLMConfig, "TTSConfig": TTSConfig}[name]
    with pytest.raises(ValueError, match=f"{name}.profile must be"):
        cls(profile="small")


def test_an_engine_may_name_its_own_profile():
    from pipeline.llm.config import LLMConfig

    built = configs(AppArgs(profile="real", device="cpu", llm={"profile": "tiny", "max_output_tokens": 9},
                            auth={"mode": "none"}))
    assert built["llm"] == LLMConfig.tiny(device="cpu", max_output_tokens=9)
    assert (built["stt"].profile, built["tts"].profile) == ("real", "real")
    with pytest.raises(ValueError, match="profile must be one of"):
        configs(AppArgs(llm={"profile": "small"}, auth={"mode": "none"}))


def test_old_llm_model_tiny_still_starts(caplog):
    """Backward-compatible alias (deployments/app.py): a yaml written when the tiny LLM was chosen
    with llm: {model: tiny} builds the tiny profile's LLM, with a deprecation warning, instead of
    looking for a checkpoint named "tiny"."""
    from pipeline.llm.config import LLMConfig

    with caplog.at_level("WARNING", logger="deployments.app"):
        built = configs(AppArgs(profile="real", device="cpu", llm={"model": "tiny", "seed": 3},
                                auth={"mode": "none"}))
    assert built["llm"] == LLMConfig.tiny(device="cpu", seed=3)
    assert "llm: {profile: tiny}" in caplog.text
