"""The alert rules (grafana/alert_rules.yml) load, and their unit tests (grafana/alert_rules.test.yml)
pass under promtool: every alert fires on a synthetic series that breaks it and stays quiet on a
healthy one. Every latency threshold is a bucket bound of pipeline/metrics.py's LATENCY_BUCKETS
(between two bounds histogram_quantile only interpolates, so a threshold there is crossed by a
guess, not by observations). promtool comes with Debian's prometheus package
(scripts/install.sh --system); without it the promtool tests skip."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

GRAFANA = Path(__file__).resolve().parents[1] / "grafana"
RULES = GRAFANA / "alert_rules.yml"
RULE_TESTS = GRAFANA / "alert_rules.test.yml"


def promtool() -> str:
    binary = shutil.which("promtool")
    if binary is None:
        if os.environ.get("CI"):
            pytest.fail("promtool is not installed: `bash scripts/install.sh --system` installs it (prometheus)")
        pytest.skip("promtool not installed (apt-get install prometheus)")
    return binary


def run_promtool(*args: str, cwd: Path = GRAFANA) -> subprocess.CompletedProcess:
    return subprocess.run([promtool(), *args], cwd=cwd, capture_output=True, text=True, timeout=120)


def test_rules_load():
    result = run_promtool("check", "rules", RULES.name)
    assert result.returncode == 0, result.stdout + result.stderr


def test_rules_pass_their_unit_tests():
    result = run_promtool("test", "rules", RULE_TESTS.name)
    assert result.returncode == 0, result.stdout + result.stderr


# Breakages the unit tests must catch: (what, text in alert_rules.yml, what replaces it everywhere).
BREAKAGES = [
    ("page burn threshold too high: the fast burn no longer pages",
     "ratio_rate1h > (14.4 * 0.001)", "ratio_rate1h > (144 * 0.001)"),
    ("no short window: the page does not clear once the burn stops",
     " and slo:chunk_gap_errors:ratio_rate5m > (14.4 * 0.001)", ""),
    ("ticket burn threshold too low: a burn within budget opens a ticket",
     "> (6 * 0.001)", "> (0.1 * 0.001)"),
    ("no traffic guard: a handful of slow replies opens a ticket",
     " and on (transport) sum by (transport) (increase(voice_voice_to_voice_seconds_count[5m])) >= 10", ""),
    ("errors per turn not per code: the code label is lost",
     "sum by (code) (rate(voice_errors_total[5m]))", "sum(rate(voice_errors_total[5m]))"),
    ("TargetDown on every job: Ray's own targets page too",
     'up{job=~"gapless|gapless-nodes"} == 0', "up == 0"),
]


@pytest.mark.parametrize("what,old,new", BREAKAGES, ids=[b[0].split(":")[0] for b in BREAKAGES])
def test_the_unit_tests_catch_a_broken_rule(tmp_path, what, old, new):
    text = RULES.read_text()
    assert old in text, f"{old!r} is not in {RULES.name}: update BREAKAGES"
    (tmp_path / RULES.name).write_text(text.replace(old, new))
    shutil.copy(RULE_TESTS, tmp_path / RULE_TESTS.name)
    assert run_promtool("check", "rules", RULES.name, cwd=tmp_path).returncode == 0, what  # still a valid rule
    result = run_promtool("test", "rules", RULE_TESTS.name, cwd=tmp_path)
    assert result.returncode != 0, f"the unit tests pass with a broken rule ({what})"


# ----------------------------------------------------------------------------- coverage of the unit tests
def _alerts(rules: dict) -> list[dict]:
    return [r for g in rules["groups"] for r in g["rules"] if "alert" in r]


def coverage_gaps(rules: dict, tests: dict) -> list[str]:
    """What the unit tests miss: an alert no test fires, an alert no test keeps quiet, a test of an
    alert that does not exist (its exp_alerts: [] would pass whatever the rules say)."""
    names = {r["alert"] for r in _alerts(rules)}
    fired, quiet = set(), set()
    for test in tests.get("tests", []):
        for case in test.get("alert_rule_test", []):
            (fired if case.get("exp_alerts") else quiet).add(case["alertname"])
    return ([f"no test fires {n}" for n in sorted(names - fired)]
            + [f"no test keeps {n} quiet" for n in sorted(names - quiet)]
            + [f"a test names {n}, which is no alert" for n in sorted((fired | quiet) - names)])


def test_every_alert_has_a_test_that_fires_it_and_one_that_keeps_it_quiet():
    tests = yaml.safe_load(RULE_TESTS.read_text())
    rules = yaml.safe_load(RULES.read_text())
    assert tests["rule_files"] == [RULES.name]
    # promtool evaluates groups in a random order unless told: an alert would read a recorded ratio
    # an evaluation old in some runs and not others
    assert tests["group_eval_order"] == [g["name"] for g in rules["groups"]]
    assert not coverage_gaps(rules, tests)


def test_the_coverage_check_catches_an_untested_alert():
    rules = {"groups": [{"name": "g", "rules": [{"alert": "A", "expr": "x > 0"}, {"alert": "B", "expr": "y > 0"}]}]}
    tests = {"tests": [{"alert_rule_test": [
        {"alertname": "A", "exp_alerts": [{"exp_labels": {}}]}, {"alertname": "A", "exp_alerts": []},
        {"alertname": "B", "exp_alerts": []}, {"alertname": "C", "exp_alerts": []}]}]}
    assert coverage_gaps(rules, tests) == ["no test fires B", "a test names C, which is no alert"]


# ----------------------------------------------------------------------------- thresholds on bucket bounds
def _quantile_thresholds(expr: str) -> list[tuple[str, str | None]]:
    """(the histogram_quantile call, the number it is compared with or None) for each call in expr."""
    found = []
    for m in re.finditer(r"histogram_quantile\(", expr):
        depth, i = 1, m.end()
        while depth:
            depth += {"(": 1, ")": -1}.get(expr[i], 0)
            i += 1
        cmp = re.match(r"\s*(?:>=|<=|>|<|==|!=)\s*([0-9.]+)", expr[i:])
        found.append((expr[m.start():i], cmp.group(1) if cmp else None))
    return found


def bucket_violations(rules: dict, buckets: tuple[float, ...]) -> list[str]:
    """Latency thresholds of the rules that are not bucket bounds: every le="N" a rule selects,
    and the number each alert compares a histogram_quantile with (an alert comparing with nothing,
    or with an expression, is reported too: the check would not see its threshold)."""
    bounds, bad = {float(b) for b in buckets}, []
    for group in rules["groups"]:
        for rule in group["rules"]:
            name, expr = rule.get("alert") or rule["record"], rule["expr"]
            for le in re.findall(r'\ble\s*=~?\s*"([^"]+)"', expr):
                if le != "+Inf" and float(le) not in bounds:
                    bad.append(f'{name}: le="{le}"')
            for call, threshold in _quantile_thresholds(expr) if "alert" in rule else ():
                if threshold is None:
                    bad.append(f"{name}: {call} is compared with no number")
                elif float(threshold) not in bounds:
                    bad.append(f"{name}: threshold {threshold}")
    return bad


def test_latency_thresholds_are_bucket_bounds():
    from pipeline.metrics import LATENCY_BUCKETS

    assert not bucket_violations(yaml.safe_load(RULES.read_text()), LATENCY_BUCKETS)


def test_the_bucket_check_catches_a_threshold_between_bounds():
    rules = {"groups": [{"name": "g", "rules": [
        {"record": "r", "expr": 'sum(rate(x_bucket{le="0.7"}[5m]))'},
        {"alert": "A", "expr": "histogram_quantile(0.95, sum by (le) (rate(x_bucket[5m]))) > 1.2 and on () y >= 10"},
        {"alert": "B", "expr": "histogram_quantile(0.9, sum by (le) (rate(x_bucket[5m]))) > 1.0"},
        {"alert": "C", "expr": "histogram_quantile(0.9, sum by (le) (rate(x_bucket[5m]))) > on () z"}]}]}
    assert bucket_violations(rules, (0.5, 1.0, 2.0)) == [
        'r: le="0.7"', "A: threshold 1.2",
        "C: histogram_quantile(0.9, sum by (le) (rate(x_bucket[5m]))) is compared with no number"]
