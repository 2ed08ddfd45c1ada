"""Autoscaling on slot occupancy (deployments/autoscaling.py, docs/scaling.md "Autoscaling on slots").

Recorded per-replica (slots in use, slots) snapshots go in, replica counts come out. Every expected
count is worked out by hand in the comment beside it, not by the policy's formula. Knobs unless a
test says otherwise: scale up above 0.75, scale down below 0.35 held for 300 s, 1..4 replicas.
"""
from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from deployments.autoscaling import IN_USE, LOW_SINCE, SLOTS, SlotPolicy, decide, slot_stats

ROOT = Path(__file__).resolve().parents[1]
KNOBS = dict(scale_up_at=0.75, scale_down_below=0.35, scale_down_after_s=300, min_replicas=1, max_replicas=4)


def run(ticks, target, low_since=None, **knobs):
    """Feed ticks (now, running, snapshots) in order; each decision is the next tick's target."""
    out = []
    for now, running, snapshots in ticks:
        target, low_since = decide(snapshots, running, target, now, low_since, **{**KNOBS, **knobs})
        out.append(target)
    return out


def test_scale_up_above_the_target_occupancy():
    # 1 replica, 7 of 8 slots: 87.5% > 75%. 2 replicas hold 16 slots, 7/16 = 44%: 2.
    assert run([(0, 1, [(7, 8)])], target=1) == [2]
    # 6 of 8 is exactly 75%: not above it, hold 1.
    assert run([(0, 1, [(6, 8)])], target=1) == [1]
    # A burst, 2 replicas full (16 of 16): 3 replicas = 24 slots, 16/24 = 67% <= 75% (2 would be 100%): 3.
    assert run([(0, 2, [(8, 8), (8, 8)])], target=2) == [3]
    # TTS with a queue: 32 slots, 32 streams in them + 8 waiting = 40 reported, 125%.
    # 2 replicas = 64 slots, 40/64 = 62.5%: 2.
    assert run([(0, 1, [(40, 32)])], target=1) == [2]


def test_hold_in_the_band():
    # 2 replicas of 8: 6 in use (37.5%), then 12 (75%, not above), then 9 (56%): 2 each time, at any age.
    ticks = [(0, 2, [(4, 8), (2, 8)]), (500, 2, [(6, 8), (6, 8)]), (1000, 2, [(5, 8), (4, 8)])]
    assert run(ticks, target=2) == [2, 2, 2]


def test_scale_down_after_sustained_low_occupancy():
    # 3 replicas of 8, 3 in use (12.5% < 35%) from t=0: low since 0; 300 s later one goes (3 -> 2).
    low3 = [(1, 8), (2, 8), (0, 8)]
    ticks = [(0, 3, low3), (100, 3, low3), (299, 3, low3), (300, 3, low3)]
    assert run(ticks, target=3) == [3, 3, 3, 2]
    # Then 2 replicas, 3 of 16 = 19%, still low: the clock starts again at 301, so 1 replica at 601.
    low2 = [(1, 8), (2, 8)]
    ticks += [(301, 2, low2), (600, 2, low2), (601, 2, low2)]
    assert run(ticks, target=3) == [3, 3, 3, 2, 2, 2, 1]


def test_a_busy_moment_restarts_the_low_clock():
    # Low at 0 (2 of 16 = 12.5%), in the band at 200 (6 of 16 = 37.5%), low again from 400:
    # the 300 s count from 400, so still 2 at 600 and 699, 1 at 700.
    ticks = [(0, 2, [(1, 8), (1, 8)]), (200, 2, [(3, 8), (3, 8)]), (400, 2, [(1, 8), (0, 8)]),
             (600, 2, [(1, 8), (0, 8)]), (699, 2, [(0, 8), (0, 8)]), (700, 2, [(0, 8), (0, 8)])]
    assert run(ticks, target=2) == [2, 2, 2, 2, 2, 1]


def test_min_and_max_replicas():
    # 4 replicas (the max) all full, 32 of 32: 32 / (0.75 * 8) = 5.3 -> 6 wanted, held at 4.
    assert run([(0, 4, [(8, 8)] * 4)], target=4) == [4]
    # 1 replica (the min) idle for 1000 s: never below 1.
    assert run([(t, 1, [(0, 8)]) for t in (0, 300, 600, 1000)], target=1) == [1, 1, 1, 1]
    # Other bounds: at most 2 even from 24 of 24 slots; at least 2 while 3 replicas idle.
    assert run([(0, 3, [(8, 8)] * 3)], target=3, max_replicas=2) == [2]
    assert run([(0, 3, [(0, 8)] * 3), (300, 3, [(0, 8)] * 3), (301, 2, [(0, 8)] * 2), (601, 2, [(0, 8)] * 2)],
               target=3, min_replicas=2) == [3, 2, 2, 2]


def test_replicas_with_no_stats_yet():
    # Nothing reported (a fresh deployment): hold whatever Serve is heading for.
    assert run([(0, 1, [])], target=1) == [1]
    assert run([(0, 2, [])], target=3) == [3]
    # A second replica started after 7 of 8 filled the first; it runs but has not reported: counted
    # empty with 8 slots, 7/16 = 44%, so no third replica for the same 7 streams.
    assert run([(0, 2, [(7, 8)])], target=2) == [2]
    # Scaled to 2, the new replica still starting (running 1): 7 of 8 wants 2, which is already the target.
    assert run([(0, 1, [(7, 8)]), (5, 1, [(8, 8)])], target=1) == [2, 2]
    # While it starts, 3 replicas asked earlier stay asked even though 7 of 8 needs only 2.
    assert run([(0, 1, [(7, 8)])], target=3) == [3]


def test_the_policy_reads_serve_metrics_and_keeps_its_clock():
    """SlotPolicy over Serve's AutoscalingContext: aggregated_metrics per replica, state carried."""
    from ray.serve.config import AutoscalingContext

    def ctx(now, per_replica, target, state, running=None):
        names = list(per_replica)
        return AutoscalingContext(
            deployment_id="TTS", deployment_name="TTS", app_name="gapless",
            current_num_replicas=len(names) if running is None else running, target_num_replicas=target,
            running_replicas=names, total_num_requests=0.0, total_queued_requests=0.0,
            aggregated_metrics={IN_USE: {r: u for r, (u, _) in per_replica.items()},
                                SLOTS: {r: s for r, (_, s) in per_replica.items()}},
            raw_metrics={}, capacity_adjusted_min_replicas=1, capacity_adjusted_max_replicas=4,
            policy_state=state, last_scale_up_time=None, last_scale_down_time=None, current_time=now, config=None)

    policy = SlotPolicy(scale_up_at=0.75, scale_down_below=0.35, scale_down_after_s=60)
    # 30 of 32 (94%): 2 replicas of 32 = 64, 30/64 = 47%: 2.
    n, state = policy(ctx(0.0, {"a": (30, 32)}, 1, {}))
    assert n == 2 and state[LOW_SINCE] is None
    # Two replicas, 5 + 3 = 8 of 64 (12.5%): low since 10; Serve's own keys in the state survive.
    n, state = policy(ctx(10.0, {"a": (5, 32), "b": (3, 32)}, 2, {**state, "serve_key": 1}))
    assert (n, state[LOW_SINCE], state["serve_key"]) == (2, 10.0, 1)
    n, state = policy(ctx(69.0, {"a": (5, 32), "b": (3, 32)}, 2, state))
    assert (n, state[LOW_SINCE]) == (2, 10.0)
    # 60 s after 10: one fewer.
    n, state = policy(ctx(70.0, {"a": (5, 32), "b": (3, 32)}, 2, state))
    assert (n, state[LOW_SINCE]) == (1, None)
    # A replica that reported only one of the two numbers counts as not reported: 2 running,
    # only "a" known (20 of 32), 20/64 = 31%, low since 100.
    partial = ctx(100.0, {"a": (20, 32)}, 2, {}, running=2)
    partial.aggregated_metrics[IN_USE]["b"] = 3  # no SLOTS for "b"
    assert policy(partial) == (2, {LOW_SINCE: 100.0})


def test_knobs_that_would_flap_are_refused():
    # Down below 0.4 with up at 0.75: 2 replicas at 39% -> 1 replica at 78%, above 75%: refused.
    with pytest.raises(ValueError, match="scale_down_below"):
        SlotPolicy(scale_up_at=0.75, scale_down_below=0.4)
    with pytest.raises(ValueError):
        SlotPolicy(scale_up_at=1.5)
    SlotPolicy(scale_up_at=0.8, scale_down_below=0.4)  # exactly half is fine


def test_replicas_report_their_slots():
    from deployments.stt import STT
    from deployments.tts import TTS

    stt = SimpleNamespace(svc=SimpleNamespace(stats=lambda: {"active_streams": 3, "slots": 8}))
    tts = SimpleNamespace(svc=SimpleNamespace(stats=lambda: {"active_requests": 35, "slots": 32}))
    assert STT.func_or_class.record_autoscaling_stats(stt) == {IN_USE: 3, SLOTS: 8}
    assert TTS.func_or_class.record_autoscaling_stats(tts) == {IN_USE: 35, SLOTS: 32}
    # Serve accepts only int or float values (ray/serve/_private/replica.py checks the first report).
    assert all(type(v) is int for v in slot_stats(3.0, 8).values())


def _gpu_deployments() -> dict:
    cfg = yaml.safe_load((ROOT / "serve_config.gpu.yaml").read_text())
    return {d["name"]: d for d in cfg["applications"][0]["deployments"]}


def _commented_stt_autoscaling() -> dict:
    """The STT's commented-out autoscaling_config in serve_config.gpu.yaml, uncommented."""
    lines = (ROOT / "serve_config.gpu.yaml").read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.strip() == "# autoscaling_config:")
    block = []
    for line in lines[start:]:
        if not line.strip().startswith("#"):
            break
        block.append(line.strip()[2:])
    return yaml.safe_load("\n".join(block))["autoscaling_config"]


def test_the_policy_module_is_light():
    """Serve's controller imports deployments.autoscaling: it must not bring torch, Ray or the engines."""
    script = ("import sys, deployments.autoscaling; "
              "print(sorted(m for m in ('torch', 'numpy', 'ray', 'pipeline') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, cwd=ROOT, timeout=120)
    assert done.returncode == 0 and done.stdout.decode().strip() == "[]", done.stderr.decode()[-2000:]


@pytest.mark.parametrize("name", ["TTS", "STT (commented)"])
def test_gpu_config_policy_builds_and_runs_without_the_project(name):
    """The yaml's autoscaling_config builds in Serve's own model (which imports the policy and
    pickles it by value), and the pickled policy runs in a process that cannot import the project
    (the controller loads that pickle, e.g. after a restart)."""
    from ray.serve.config import AutoscalingConfig

    raw = _gpu_deployments()["TTS"]["autoscaling_config"] if name == "TTS" else _commented_stt_autoscaling()
    config = AutoscalingConfig(**raw)
    assert config.policy.policy_function == "deployments.autoscaling:SlotPolicy"
    assert (config.upscale_delay_s, config.downscale_delay_s) == (0, 0)
    assert config.min_replicas >= 1 and config.max_replicas > config.min_replicas
    SlotPolicy(**config.policy.policy_kwargs)  # valid knobs
    script = textwrap.dedent("""
        import sys
        sys.modules["deployments"] = sys.modules["pipeline"] = None  # the project cannot be imported
        from ray import cloudpickle
        policy = cloudpickle.loads(sys.stdin.buffer.read())(scale_up_at=0.75, scale_down_below=0.35)
        from types import SimpleNamespace
        ctx = SimpleNamespace(aggregated_metrics={"slots_in_use": {"a": 7}, "slots": {"a": 8}}, policy_state={},
                              current_time=0.0, current_num_replicas=1, target_num_replicas=1,
                              capacity_adjusted_min_replicas=1, capacity_adjusted_max_replicas=4)
        print(policy(ctx)[0])
    """)
    done = subprocess.run([sys.executable, "-c", script], input=config.policy.get_serialized_policy_def(),
                          capture_output=True, cwd="/", timeout=120)
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    assert done.stdout.decode().strip() == "2"  # 7 of 8 (87.5%) on 1 replica: 2


def test_serve_passes_the_decision_through():
    """Serve wraps a custom policy (scaling factors, delays, then min/max). With the config's delays
    at 0 it adds no wait of its own: the policy's count is the count. Uses Serve's private wrapper
    (ray/serve/autoscaling_policy.py, Ray 2.60); skipped if a Ray upgrade moves it."""
    from ray.serve.config import AutoscalingConfig, AutoscalingContext

    try:
        from ray.serve.autoscaling_policy import _apply_autoscaling_config
    except ImportError:
        pytest.skip("Serve's policy wrapper moved")
    config = AutoscalingConfig(**_gpu_deployments()["TTS"]["autoscaling_config"])
    policy = _apply_autoscaling_config(SlotPolicy(**config.policy.policy_kwargs))

    def tick(now, per_replica, target, state):
        return policy(AutoscalingContext(
            deployment_id="TTS", deployment_name="TTS", app_name="gapless", current_num_replicas=len(per_replica),
            target_num_replicas=target, running_replicas=list(per_replica), total_num_requests=1.0,
            total_queued_requests=0.0,
            aggregated_metrics={IN_USE: {r: u for r, (u, _) in per_replica.items()},
                                SLOTS: {r: s for r, (_, s) in per_replica.items()}},
            raw_metrics={}, capacity_adjusted_min_replicas=1, capacity_adjusted_max_replicas=4,
            policy_state=state, last_scale_up_time=None, last_scale_down_time=None, current_time=now, config=config))

    # 30 of 32 (94%) -> 2 at once (30/64 = 47%).
    n, state = tick(1000.0, {"a": (30, 32)}, 1, {})
    assert n == 2
    # 4 of 64 (6%) from 1010: still 2 at 1309, 1 at 1310 (scale_down_after_s 300 in the yaml).
    low = {"a": (2, 32), "b": (2, 32)}
    n, state = tick(1010.0, low, 2, state)
    assert n == 2
    n, state = tick(1309.0, low, 2, state)
    assert n == 2
    n, state = tick(1310.0, low, 2, state)
    assert n == 1
