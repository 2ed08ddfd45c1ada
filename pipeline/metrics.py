"""The Prometheus metrics of the pipeline (names, buckets, help) and their exposition.

Every deployment process records into ``prometheus_client`` metrics defined here. Under Ray
Serve all processes of a node share one ``PROMETHEUS_MULTIPROC_DIR`` (set by the app's
runtime_env), so the gateway's ``GET /metrics`` exposes the sum over every replica of the
node; outside Ray (tests, benchmarks) the metrics live in the process registry.
Names are stable: dashboards and alert rules in ``grafana/`` query them.
"""
from __future__ import annotations

import os
import re

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client import CONTENT_TYPE_LATEST  # noqa: F401 - re-exported for the gateway

from pipeline.private_dir import ensure_private_dir

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
if os.environ.get(MULTIPROC_ENV):
    os.makedirs(os.environ[MULTIPROC_ENV], exist_ok=True)

# Buckets that resolve the chunk-gap SLO (500 ms) and time-to-first-audio targets.
LATENCY_BUCKETS = (0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 2.0, 5.0, 10.0)
RTF_BUCKETS = (0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 5.0)

AUDIO_CHUNK_GAP = Histogram(
    "voice_audio_chunk_gap_seconds",
    "Time between consecutive audio messages of one reply, as the gateway sends them.",
    buckets=LATENCY_BUCKETS,
)
TIME_TO_FIRST_AUDIO = Histogram(
    "voice_time_to_first_audio_seconds",
    "End of the user turn to the first audio message of the reply.",
    buckets=LATENCY_BUCKETS,
)
STT_STEP = Histogram("voice_stt_step_seconds", "One batched STT step.", buckets=LATENCY_BUCKETS)
STT_ACTIVE_STREAMS = Gauge(
    "voice_stt_active_streams", "Streams holding an STT slot.", multiprocess_mode="livesum"
)
STT_STREAMS_OPENED = Counter(
    "voice_stt_streams_opened", "STT streams (spoken turns) opened, by replica.", ["replica"]
)
STT_UNKNOWN_STREAMS = Counter(
    "voice_stt_unknown_streams",
    "Calls for a stream the STT replica does not hold (a misroute or a replaced replica), by replica.",
    ["replica"],
)
LLM_TIME_TO_FIRST_TOKEN = Histogram(
    "voice_llm_time_to_first_token_seconds", "LLM request to its first text delta.", buckets=LATENCY_BUCKETS
)
TTS_TIME_TO_FIRST_CHUNK = Histogram(
    "voice_tts_time_to_first_chunk_seconds", "TTS request to its first audio chunk.", buckets=LATENCY_BUCKETS
)
TTS_REAL_TIME_FACTOR = Histogram(
    "voice_tts_real_time_factor", "TTS compute time over audio duration, per request.", buckets=RTF_BUCKETS
)
COMPILES_AFTER_WARMUP = Counter(
    "voice_compiles_after_warmup", "Compilations after warm-up (should stay 0).", ["deployment"]
)
UNSEEN_SHAPES_AFTER_WARMUP = Counter(
    "voice_unseen_shapes_after_warmup",
    "Calls of a compiled step with a shape warm-up did not cover, run eagerly instead (should stay 0).",
    ["deployment"],
)
SESSIONS_ACTIVE = Gauge("voice_sessions_active", "Open WebSocket sessions.", multiprocess_mode="livesum")
TURNS = Counter("voice_turns", "User turns ended (spoken or typed).")
BARGE_INS = Counter("voice_barge_ins", "Replies interrupted by a new user turn.")
TURN_ENDS = Counter("voice_turn_ends", "User turns ended, by what ended them: smart_turn, silence (a pause past "
                    "eot_max_silence_ms), turn_end, typed, endpoint, max_turn.", ["by"])
SPECULATIONS = Counter("voice_preemptive_generations", "LLM starts at a hands-free pause, before the turn's end "
                       "(preemptive_generation), by outcome: hit (the reply used it), miss (the turn ended with "
                       "another prompt), cancelled (the user spoke on).", ["outcome"])
for _outcome in ("hit", "miss", "cancelled"):
    SPECULATIONS.labels(outcome=_outcome)  # exported at 0 from the start
SMART_TURN = Histogram("voice_smart_turn_seconds", "One Smart Turn end-of-turn call (gateway).", buckets=LATENCY_BUCKETS)
ERRORS = Counter("voice_errors", "Error messages sent to clients, by code.", ["code"])
HANDSHAKES_REFUSED = Counter("voice_handshakes_refused", "Connections and ticket requests refused before the "
                             "upgrade, by code (unauthorized, origin_not_allowed, too_many_handshakes, "
                             "too_many_sessions).", ["code"])


def exposition() -> bytes:
    """Prometheus text format: every process of this node under Ray, else this process. The
    live-sum gauges (sessions, STT streams) leave out processes that have died (a killed replica
    never says so itself)."""
    if os.environ.get(MULTIPROC_ENV):
        from prometheus_client import multiprocess

        forget_dead_processes(os.environ[MULTIPROC_ENV])
        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry)
        return generate_latest(registry)
    return generate_latest()


_LIVE_FILE = re.compile(r"^gauge_live\w+_(\d+)\.db$")


def forget_dead_processes(path: str) -> list[int]:
    """``mark_process_dead`` for every process whose live gauges are in ``path`` but which no
    longer runs; returns their pids."""
    from prometheus_client import multiprocess

    pids = {int(m.group(1)) for m in map(_LIVE_FILE.match, os.listdir(path)) if m}
    dead = [pid for pid in sorted(pids) if not _running(pid)]
    for pid in dead:
        multiprocess.mark_process_dead(pid, path)
    return dead


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        return True
    return True


def prepare_multiproc_dir(path: str) -> None:
    """Empty the shared metrics directory at app start (stale files of dead processes). It must be
    this user's alone (``pipeline.private_dir``; NotPrivate stops the start, naming the fix)."""
    ensure_private_dir(path)
    for name in os.listdir(path):
        if name.endswith(".db"):
            os.remove(os.path.join(path, name))
