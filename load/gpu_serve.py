"""The Python half of load/gpu_serve.sh: the config it serves, what it reads from /metrics, its report.

    python -m load.gpu_serve config OUT.yaml [--dry-run]   # serve_config.gpu.yaml as the run serves it
    python -m load.gpu_serve metrics OUT.json              # compiles after warm-up, GPU memory per replica
    python -m load.gpu_serve wait PID TIMEOUT_S            # seconds until /healthz answers 200 (exit 1: never)
    python -m load.gpu_serve report OUT_DIR                # summary.json + facts.tsv -> tables.md

``config``: serve_config.gpu.yaml with ``profile: full`` (random weights at the real shapes: no
checkpoint), its auth on with a throw-away token ($GAPLESS_TOKENS), listening on loopback (the load
runs on the same machine) and with per-client limits raised for one load host. With ``--dry-run``
(a 2-core CPU): the same session and auth settings and the same deployments (replica counts,
gateways, autoscaling, GPU shares: load/gpu_serve.sh tells Ray the node has one GPU), with
serve_config.yaml's tiny engines and CPU shares, since a CPU has no CUDA graphs to capture.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import yaml
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parents[1]
GPU_CONFIG = ROOT / "serve_config.gpu.yaml"
CPU_CONFIG = ROOT / "serve_config.yaml"
REPLY_TOKENS = 24
LOAD_HOST_SESSIONS = 512  # sessions one load host may hold at once (every load client is 127.0.0.1)


def served_config(dry_run: bool) -> dict:
    cfg = yaml.safe_load(GPU_CONFIG.read_text())
    app = cfg["applications"][0]
    args = app["args"]
    cfg["http_options"]["host"] = "127.0.0.1"
    app["runtime_env"]["env_vars"]["GAPLESS_NODE_METRICS"] = "127.0.0.1:9464"
    args["session"].update(max_sessions_per_client=LOAD_HOST_SESSIONS, handshakes_per_minute=100_000)
    args["auth"].update(mode="token", tokens_env="GAPLESS_TOKENS", tokens_file=None)
    if dry_run:
        tiny = yaml.safe_load(CPU_CONFIG.read_text())["applications"][0]
        args.update(profile="tiny", device="cpu", stt=tiny["args"]["stt"], tts=tiny["args"]["tts"])
        app["deployments"] = dry_run_deployments(app["deployments"], tiny["deployments"])
    else:
        args["profile"] = "full"
        # Replies as long as on the CPU runs (the tiny profile's 24 tokens, ~8 s of speech; a voice
        # agent's are short): full's 128 random tokens would speak for ~45 s a turn, past the lease.
        args["llm"] = {**args.get("llm", {}), "max_output_tokens": REPLY_TOKENS}
    return cfg


def dry_run_deployments(gpu: list[dict], tiny: list[dict]) -> list[dict]:
    """The GPU config's deployments as they are (replica counts, four gateways, the TTS's slot
    autoscaling, each replica's GPU share, placed by Ray on a node started with one GPU), with each
    replica's CPU share cut to the tiny config's: a share is the replica's torch threads, and a 2-core
    machine oversubscribed by 2 threads a replica runs a step 20-60x slower (docs/concurrency.md)."""
    tiny_cpus = {d["name"]: d.get("ray_actor_options", {}).get("num_cpus") for d in tiny}
    out = []
    for d in gpu:
        d = {**d, "ray_actor_options": dict(d.get("ray_actor_options", {}))}
        if tiny_cpus.get(d["name"]) is not None:
            d["ray_actor_options"]["num_cpus"] = tiny_cpus[d["name"]]
        out.append(d)
    return out


def scrape(url: str, token: str | None) -> dict:
    """What the run records from the app's /metrics: compiles and unseen shapes after warm-up by
    deployment, GPU memory and utilisation by replica process, the gateway's chunk-gap histogram,
    and the server's voice-to-voice and barge-in means by transport."""
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    with urllib.request.urlopen(req, timeout=10) as r:
        text = r.read().decode()
    out: dict = {"compiles_after_warmup": {}, "unseen_shapes_after_warmup": {}, "gpu_memory_mib": {},
                 "gpu_utilization": {}, "chunk_gaps": {}, "server_ms": {}}
    sums: dict = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "voice_compiles_after_warmup_total":
                out["compiles_after_warmup"][s.labels["deployment"]] = s.value
            elif s.name == "voice_unseen_shapes_after_warmup_total":
                out["unseen_shapes_after_warmup"][s.labels["deployment"]] = s.value
            elif s.name == "voice_gpu_memory_bytes":
                key = f"{s.labels['deployment']} (pid {s.labels.get('pid', '?')})"
                out["gpu_memory_mib"].setdefault(key, {})[s.labels["kind"]] = round(s.value / 2**20)
            elif s.name == "voice_gpu_utilization_ratio":
                out["gpu_utilization"][f"{s.labels['deployment']} (pid {s.labels.get('pid', '?')})"] = s.value
            elif s.name == "voice_audio_chunk_gap_seconds_bucket" and s.labels["le"] in ("0.5", "+Inf"):
                out["chunk_gaps"]["le_0.5" if s.labels["le"] == "0.5" else "all"] = s.value
            elif s.name.startswith(("voice_voice_to_voice_seconds_", "voice_barge_in_seconds_")) and \
                    s.name.endswith(("_sum", "_count")) and s.labels.get("transport"):
                key = f"{s.name.split('_seconds_')[0].removeprefix('voice_')} {s.labels['transport']}"
                sums.setdefault(key, [0.0, 0.0])[s.name.endswith("_count")] += s.value
    # the server's own means (end of speech, or speech onset, on the client's audio clock)
    out["server_ms"] = {k: round(1000 * total / n) for k, (total, n) in sorted(sums.items()) if n}
    gaps = out["chunk_gaps"]
    if gaps:
        gaps["over_0.5"] = gaps.get("all", 0) - gaps.get("le_0.5", 0)
    return out


def healthz(base: str = "http://127.0.0.1:8000") -> int | None:
    try:
        with urllib.request.urlopen(f"{base}/healthz", timeout=5) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except OSError:
        return None


def wait_healthy(pid: int, timeout_s: float) -> float | None:
    """Seconds until /healthz answers 200; None when ``pid`` (serve run) exits or time runs out."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        if healthz() == 200:
            return time.monotonic() - t0
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return None
        time.sleep(1)
    return None


def wait_down(timeout_s: float = 60) -> bool:
    t0 = time.monotonic()
    while healthz() is not None:
        if time.monotonic() - t0 > timeout_s:
            return False
        time.sleep(0.5)
    return True


def _facts(out: Path) -> dict:
    facts = {}
    path = out / "facts.tsv"
    for line in (path.read_text().splitlines() if path.exists() else []):
        key, _, value = line.partition("\t")
        try:
            facts[key] = json.loads(value)
        except ValueError:
            facts[key] = value
    return facts


def _levels(res: dict, protocol: str) -> list[dict]:
    """The levels of the steps cost_PROTOCOL_N, in the order they ran."""
    return [lv for name, r in res.items() if name.startswith(f"cost_{protocol}_") for lv in r.get("levels", [])]


def _level_rows(levels: list[dict], protocol: str) -> list[str]:
    rows = []
    for lv in levels:
        cpu = lv["cpu_s_per_conversation_s"]
        gpu = (lv.get("gpu") or {}).get("gpu_s_per_conversation_s")
        rows.append(f"| {protocol} | {lv['sessions']} | {lv['turns']} | {lv['gap_p50_ms']} | {lv['gap_p99_ms']} | "
                    f"{lv['gap_max_ms']} | {lv['gaps_over_limit']} | {lv['ttfa_p50_ms']} | {lv['ttfa_p95_ms']} | "
                    f"{lv['errors']} | {cpu['total']} | {'-' if gpu is None else gpu} |")
    return rows


def report(out: Path) -> str:
    """The run's tables (markdown) from OUT/summary.json (load/step_summary.py) and OUT/facts.tsv."""
    summary = json.loads((out / "summary.json").read_text()) if (out / "summary.json").exists() else {}
    facts = _facts(out)
    res = {name: (step.get("result") or {}) for name, step in summary.items()}
    lines = [f"# Served run: {facts.get('label', 'gpu_serve')}", "",
             f"{facts.get('device', '?')}; {facts.get('versions', '')}", "", "## Steps", "",
             "| step | exit | seconds |", "|---|---|---|"]
    lines += [f"| {n} | {s['rc']} | {s['seconds']} |" for n, s in summary.items()]
    lines += ["", "## Start", "", "| | seconds to /healthz 200 |", "|---|---|",
              f"| cold (first start on this machine) | {facts.get('cold_start_s', '-')} |",
              f"| warm (second start: compile cache and page cache warm) | {facts.get('warm_start_s', '-')} |"]
    gap = res.get("gaps", {})
    if gap:
        lines += ["", "## One conversation (load.gaps)", "", "| turns | chunks | gap p50 / p99 / max ms | over 500 ms | "
                  "TTFA p50 / p95 ms | errors |", "|---|---|---|---|---|---|",
                  f"| {gap.get('turns')} | {gap.get('chunks')} | {gap.get('gap_p50_ms')} / {gap.get('gap_p99_ms')} / "
                  f"{gap.get('gap_max_ms')} | {gap.get('gaps_over_limit')} | {gap.get('ttfa_p50_ms')} / "
                  f"{gap.get('ttfa_p95_ms')} | {gap.get('errors')} |"]
    lines += ["", "## N conversations (load.cost: load.concurrency's levels, CPU and GPU per conversation-second)", "",
              "| protocol | N | turns | gap p50 | p99 | max | >500 ms | TTFA p50 | p95 | errors | CPU s/conv-s | "
              "GPU s/conv-s |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    lines += _level_rows(_levels(res, "v1"), "v1") + _level_rows(_levels(res, "realtime"), "realtime")
    first_bad = [lv["sessions"] for p in ("v1", "realtime") for lv in _levels(res, p) if lv["gaps_over_limit"] or lv["errors"]]
    lines += ["", f"N at which gaps over 500 ms (or errors) first appear: {min(first_bad) if first_bad else 'none up to the largest N run'}"]
    turn = res.get("turn_taking", {}).get("turn_test")
    if turn:
        split = turn["voice_to_voice_split_ms"]
        v2v = turn["voice_to_voice_ms"]
        lines += ["", "## Voice to voice (load.turn_taking)", "", "| measure | ms |", "|---|---|",
                  f"| voice-to-voice p50 / p95 / max ({v2v.get('n')} turns) | {v2v.get('p50')} / {v2v.get('p95')} / "
                  f"{v2v.get('max')} |"]
        lines += [f"| {k} (p50) | {v} |" for k, v in split.items()]
        barge = turn.get("barge_in_ms", {})
        lines += [f"| barge-in p50 / max ({barge.get('n')} of {barge.get('of')}) | {barge.get('p50')} / "
                  f"{barge.get('max')} |"]
    metrics = facts.get("metrics_after_load") or {}
    if metrics:
        lines += ["", "## After the load (/metrics)", "",
                  f"- compiles after warm-up: {metrics.get('compiles_after_warmup')}",
                  f"- unseen shapes after warm-up: {metrics.get('unseen_shapes_after_warmup')}",
                  f"- chunk gaps the gateways saw: {metrics.get('chunk_gaps')}",
                  f"- the server's means (ms): {metrics.get('server_ms')}",
                  f"- GPU utilisation at the scrape (NVML): {metrics.get('gpu_utilization')}", "",
                  "| replica | reserved MiB | peak reserved MiB |", "|---|---|---|"]
        lines += [f"| {k} | {v.get('reserved')} | {v.get('peak_reserved')} |"
                  for k, v in sorted(metrics.get("gpu_memory_mib", {}).items())]
    for key in ("gpu_memory_before_mib", "gpu_memory_healthy_mib", "gpu_memory_after_load_mib"):
        if key in facts:
            lines.append(f"- nvidia-smi memory.used, {key.removeprefix('gpu_memory_').removesuffix('_mib')}: "
                         f"{facts[key]} MiB")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("config")
    c.add_argument("out", type=Path)
    c.add_argument("--dry-run", action="store_true")
    m = sub.add_parser("metrics")
    m.add_argument("out", type=Path)
    m.add_argument("--url", default="http://127.0.0.1:8000/metrics")
    w = sub.add_parser("wait")
    w.add_argument("pid", type=int)
    w.add_argument("timeout_s", type=float)
    sub.add_parser("down")
    r = sub.add_parser("report")
    r.add_argument("out", type=Path)
    args = ap.parse_args(argv)
    if args.cmd == "config":
        args.out.write_text(yaml.safe_dump(served_config(args.dry_run), sort_keys=False))
    elif args.cmd == "metrics":
        snap = scrape(args.url, os.environ.get("GAPLESS_TOKEN"))
        args.out.write_text(json.dumps(snap))
        print(json.dumps(snap))
    elif args.cmd == "wait":
        took = wait_healthy(args.pid, args.timeout_s)
        if took is None:
            print(f"not healthy (serve run exited, or {args.timeout_s:.0f} s passed)", file=sys.stderr)
            return 1
        print(round(took, 1))
    elif args.cmd == "down":
        return 0 if wait_down() else 1
    else:
        text = report(args.out)
        (args.out / "tables.md").write_text(text)
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
