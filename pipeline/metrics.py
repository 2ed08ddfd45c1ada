"""The Prometheus metrics of the pipeline (names, buckets, help) and their exposition.

Every deployment process records into ``prometheus_client`` metrics defined here. Under Ray
Serve all processes of a node share one ``PROMETHEUS_MULTIPROC_DIR`` (set by the app's
runtime_env), so the gateway's ``GET /metrics`` exposes the sum over every replica of the
node; outside Ray (tests, benchmarks) the metrics live in the process registry.

A cluster of several nodes has one such directory per node, and the gateway reads only its own.
So each node is also its own scrape target (:func:`serve_node_metrics`): every replica process
tries to listen on the node's metrics address (``GAPLESS_NODE_METRICS``, default
``127.0.0.1:9464``); one wins, serves the node's directory (:class:`NodeExporter`), and when it
dies another replica of the node takes the port over within ``NODE_RETRY_S``. Prometheus finds
the nodes through the file Ray's head writes for it (grafana/prometheus.nodes.yml,
docs/scaling.md "Metrics on several nodes").

The exporter runs inside a replica process, so no client may hold it: it is the standard
library's threading HTTP server with prometheus_client's own handler, each connection cut
``NODE_TIMEOUT_S`` after it was accepted (whatever it sends meanwhile), at most
``NODE_MAX_THREADS`` connections served at once (one more is closed as it arrives), one request
per connection. Off loopback every scrape needs ``Authorization: Bearer <token>`` with one of
the clients' tokens (``$GAPLESS_TOKENS``, read and checked as the gateway reads them; its own
``/metrics`` takes the same); without a token there it does not listen at all.
Names are stable: dashboards and alert rules in ``grafana/`` query them.
"""
from __future__ import annotations

import hmac
import ipaddress
import logging
import os
import re
import socket
import threading
import time
from http.server import ThreadingHTTPServer

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, MetricsHandler, generate_latest
from prometheus_client import CONTENT_TYPE_LATEST  # noqa: F401 - re-exported for the gateway

from pipeline import errors
from pipeline.door.auth import AuthConfig, bearer, load_tokens
from pipeline.conversation.observer import Observer
from pipeline.runtime.private_dir import ensure_private_dir

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
NODE_METRICS_ENV = "GAPLESS_NODE_METRICS"  # HOST:PORT of this node's scrape target, or "off"
NODE_METRICS_DEFAULT = "127.0.0.1:9464"
NODE_RETRY_S = 5.0  # how often a replica that does not hold the node's port tries to take it
NODE_TOKENS_ENV = "GAPLESS_TOKENS"  # the bearer tokens a scrape must send where the exporter is off loopback
NODE_TIMEOUT_S = 5.0  # a scrape connection's whole life, from accept to close
NODE_MAX_THREADS = 4  # scrape connections served at once
log = logging.getLogger(__name__)
if os.environ.get(MULTIPROC_ENV):
    os.makedirs(os.environ[MULTIPROC_ENV], exist_ok=True)

# Buckets that hold every threshold the alert rules and the record use (grafana/alert_rules.yml;
# a dead-air gap is one over 150 ms; the chunk-gap SLO is 500 ms, voice-to-voice 1 s, first audio 1.5 s).
LATENCY_BUCKETS = (0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.25, 0.3, 0.4, 0.5, 0.6, 0.75, 1.0, 1.5, 2.0,
                   3.0, 5.0, 10.0)
TRANSPORTS = ("v1", "realtime", "webrtc", "phone")  # the ``transport`` label's values
DEAD_AIR_CAUSES = ("recogniser", "llm", "tts", "client", "engine_unavailable")  # pipeline/conversation/dead_air.py
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
VOICE_TO_VOICE = Histogram(
    "voice_voice_to_voice_seconds",
    "End of the user's speech (the VAD's speech end hands-free; turn.end or commit push-to-talk, by the "
    "client's audio clock) to the reply's first audio sent, by transport.", ["transport"], buckets=LATENCY_BUCKETS)
BARGE_IN = Histogram(
    "voice_barge_in_seconds",
    "Speech onset over a playing reply (by the client's audio clock) to the reply's audio stopping, by transport.",
    ["transport"], buckets=LATENCY_BUCKETS)
STT_FINAL = Histogram(
    "voice_stt_final_seconds", "End of the user's speech to the turn's final transcript.", buckets=LATENCY_BUCKETS)
DEAD_AIR = Histogram(
    "voice_dead_air_seconds", "Dead air inside a reply: its audio ran out this long (over 150 ms) before the next "
    "chunk was sent, by the stage that was late (recogniser, llm, tts, client, engine_unavailable).", ["cause"],
    buckets=LATENCY_BUCKETS)
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
# Labelled, so only the TTS replicas' processes have the series (an unlabelled multiprocess gauge
# is written at 0 by every process that imports this module; a label's child exists once used).
TTS_SLOTS_BUSY = Gauge(
    "voice_tts_slots_busy", "TTS slots (streams in the batched step) in use, per TTS replica.", ["deployment"],
    multiprocess_mode="liveall")
TTS_SLOTS = Gauge("voice_tts_slots", "TTS slots per TTS replica.", ["deployment"], multiprocess_mode="liveall")
GPU_UTILIZATION = Gauge(
    "voice_gpu_utilization_ratio", "Utilisation of a model replica's GPU (NVML: the share of the last sample period "
    "a kernel ran), 0 to 1. Absent where there is no GPU (or no NVML).", ["deployment"], multiprocess_mode="liveall")
GPU_MEMORY = Gauge(
    "voice_gpu_memory_bytes", "GPU memory of a model replica's process, from torch's caching allocator: reserved "
    "now, and the most reserved since the process started (peak_reserved). A CUDA context's own ~0.5 GB is not in "
    "it (nvidia-smi counts it).", ["deployment", "kind"], multiprocess_mode="liveall")
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
CALLS = Counter("voice_calls", "Phone calls' media streams opened, by carrier.", ["provider"])
WEBRTC_CALLS = Counter("voice_webrtc_calls", "WebRTC calls answered (POST /v1/realtime/calls).")
WEBRTC_CANDIDATES_DROPPED = Counter(
    "voice_webrtc_candidates_dropped", "ICE candidates of WebRTC offers this server sends no checks to, by reason: "
    "not_public (private, loopback, link-local, multicast, reserved, outside webrtc.allowed_candidate_networks), "
    "own_host, name (mDNS), transport (not UDP), malformed.", ["reason"])
WEBRTC_JITTER = Histogram(
    "voice_webrtc_jitter_seconds", "RTP jitter of WebRTC calls' audio as RTCP reports it: in (the caller's, as "
    "received here), out (the reply's, as the caller's receiver reports it).", ["direction"], buckets=LATENCY_BUCKETS)
WEBRTC_PACKETS_LOST = Counter(
    "voice_webrtc_packets_lost", "RTP packets of WebRTC calls' audio lost, as RTCP reports them.", ["direction"])
PHONE_PLAYBACK_DELAY = Histogram(
    "voice_phone_playback_delay_seconds", "A phone call's reply chunk, from sent to played on the caller's phone "
    "(its mark's echo): the carrier's buffer and the network.", ["provider"], buckets=LATENCY_BUCKETS)
PHONE_GAP = Histogram(
    "voice_phone_gap_seconds", "Dead air a caller heard inside a reply, before a chunk, measured by the carrier's "
    "mark echoes.", ["provider"], buckets=LATENCY_BUCKETS)
ERRORS = Counter("voice_errors", "Error messages sent to clients, by code.", ["code"])
HANDSHAKES_REFUSED = Counter("voice_handshakes_refused", "Connections and ticket requests refused before the "
                             "upgrade, by code (unauthorized, origin_not_allowed, too_many_handshakes, "
                             "too_many_sessions).", ["code"])


def webrtc_stats(direction: str, jitter_s: float, lost: int) -> None:
    """One reading of a WebRTC call's RTCP numbers (pipeline/adapters/webrtc/peer.py)."""
    WEBRTC_JITTER.labels(direction=direction).observe(jitter_s)
    WEBRTC_PACKETS_LOST.labels(direction=direction).inc(lost)


class MetricsObserver(Observer):
    """A conversation's observer that counts into this process's Prometheus series (the gateway's);
    ``transport``: the session's (one of TRANSPORTS), the label of its latency series."""

    def __init__(self, transport: str = "v1"):
        if transport not in TRANSPORTS:
            raise ValueError(f"transport {transport!r}: expected one of {TRANSPORTS}")
        self.transport = transport

    def voice_to_voice(self, seconds: float) -> None:
        VOICE_TO_VOICE.labels(transport=self.transport).observe(seconds)

    def barge_in(self, seconds: float) -> None:
        BARGE_IN.labels(transport=self.transport).observe(seconds)

    def stt_final(self, seconds: float) -> None:
        STT_FINAL.observe(seconds)

    def dead_air(self, seconds: float, cause: str) -> None:
        DEAD_AIR.labels(cause=cause).observe(seconds)

    def chunk_gap(self, seconds: float) -> None:
        AUDIO_CHUNK_GAP.observe(seconds)

    def first_audio(self, seconds: float) -> None:
        TIME_TO_FIRST_AUDIO.observe(seconds)

    def turn_ended(self, by: str) -> None:
        TURNS.inc()
        TURN_ENDS.labels(by=by).inc()

    def interrupted(self) -> None:
        BARGE_INS.inc()

    def error(self, code: str) -> None:
        ERRORS.labels(code=code).inc()

    def smart_turn(self, seconds: float) -> None:
        SMART_TURN.observe(seconds)

    def speculation(self, outcome: str) -> None:
        SPECULATIONS.labels(outcome=outcome).inc()

    def phone_playback(self, provider: str, seconds: float) -> None:
        PHONE_PLAYBACK_DELAY.labels(provider=provider).observe(seconds)

    def phone_gap(self, provider: str, seconds: float) -> None:
        PHONE_GAP.labels(provider=provider).observe(seconds)


class NodeCollector:
    """Every process of the node that records into ``path``, summed; the live-sum gauges leave
    out processes that have died (a killed replica never says so itself)."""

    def __init__(self, path: str):
        self.path = path

    def collect(self):
        from prometheus_client import multiprocess

        forget_dead_processes(self.path)
        return multiprocess.MultiProcessCollector(None, self.path).collect()


def _node_registry(path: str) -> CollectorRegistry:
    registry = CollectorRegistry()
    registry.register(NodeCollector(path))
    return registry


def export_gateway_series() -> None:
    """The gateway's labelled series, exported at 0 from the start (a dashboard's rate and an
    alert's expression see a series that has not happened yet)."""
    for code in (errors.E_INTERNAL, errors.E_NO_FREE_SLOT, errors.E_SERVER_BUSY, errors.E_IDLE_TIMEOUT,
                 errors.E_TURN_TOO_LONG, errors.E_ENGINE_UNAVAILABLE, errors.E_AUDIO_TOO_FAST):
        ERRORS.labels(code=code).inc(0)
    for by in ("smart_turn", "silence", "turn_end", "typed", "endpoint", "max_turn", "short"):
        TURN_ENDS.labels(by=by).inc(0)
    for code in ("unauthorized", "origin_not_allowed", "host_not_allowed", "too_many_handshakes", "too_many_sessions"):
        HANDSHAKES_REFUSED.labels(code=code).inc(0)
    for direction in ("in", "out"):
        WEBRTC_JITTER.labels(direction=direction)
        WEBRTC_PACKETS_LOST.labels(direction=direction).inc(0)
    for reason in ("not_public", "own_host", "name", "transport", "malformed"):
        WEBRTC_CANDIDATES_DROPPED.labels(reason=reason).inc(0)
    for transport in TRANSPORTS:
        VOICE_TO_VOICE.labels(transport=transport)
        BARGE_IN.labels(transport=transport)
    for cause in DEAD_AIR_CAUSES:
        DEAD_AIR.labels(cause=cause)
    for provider in ("twilio", "telnyx"):
        CALLS.labels(provider=provider).inc(0)
        PHONE_PLAYBACK_DELAY.labels(provider=provider)
        PHONE_GAP.labels(provider=provider)


def exposition() -> bytes:
    """Prometheus text format: every process of this node under Ray, else this process."""
    if os.environ.get(MULTIPROC_ENV):
        return generate_latest(_node_registry(os.environ[MULTIPROC_ENV]))
    return generate_latest()


def node_metrics_address(value: str | None = None) -> tuple[str, int] | None:
    """``GAPLESS_NODE_METRICS`` (or ``value``) as (host, port); None when it is ``off``."""
    value = (os.environ.get(NODE_METRICS_ENV, NODE_METRICS_DEFAULT) if value is None else value).strip()
    if value.lower() == "off":
        return None
    host, _, port = value.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{NODE_METRICS_ENV}={value!r}: expected HOST:PORT (e.g. 127.0.0.1:9464) or off")
    return host.strip("[]"), int(port)


def is_loopback(host: str) -> bool:
    """Whether a server listening on ``host`` is reachable from this machine only. Anything else
    (``0.0.0.0``, ``::``, an interface's address, a name other than localhost) counts as open."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def exporter_tokens(host: str, environ: dict[str, str] | None = None) -> tuple[str, ...]:
    """The bearer tokens a scrape of an exporter on ``host`` must send: none on loopback, else
    those of ``$GAPLESS_TOKENS`` (as the gateway checks them). ValueError where there is none."""
    environ = os.environ if environ is None else environ
    if is_loopback(host):
        return ()
    if not environ.get(NODE_TOKENS_ENV, "").strip():
        raise ValueError(f"${NODE_TOKENS_ENV} holds no token, and off loopback a scrape must send one")
    return load_tokens(AuthConfig(tokens_env=NODE_TOKENS_ENV), environ)


class _ScrapeHandler(MetricsHandler):
    """prometheus_client's handler (its ``registry``), answering 401 unless the request carries
    one of ``tokens`` (none: no token needed)."""

    tokens: tuple[str, ...] = ()

    def do_GET(self) -> None:
        if self.tokens and not _token_ok(bearer({"authorization": self.headers.get("Authorization", "")}),
                                         self.tokens):
            self.send_response(401)
            self.send_header("WWW-Authenticate", "Bearer")
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        super().do_GET()


def _token_ok(given: str | None, tokens: tuple[str, ...]) -> bool:
    """Constant time in the tokens' content: every one is compared."""
    matches = [hmac.compare_digest((given or "").encode(), t.encode()) for t in tokens]
    return given is not None and any(matches)


class NodeExporter(ThreadingHTTPServer):
    """A node's scrape target, listening on ``address`` once constructed (OSError where it cannot:
    the port is taken). A connection lives at most ``timeout_s``; one arriving while
    ``max_threads`` are being served is closed at once. Serve with ``serve_forever``."""

    daemon_threads = True

    def __init__(self, address: tuple[str, int], registry: CollectorRegistry, tokens: tuple[str, ...] = (),
                 timeout_s: float = NODE_TIMEOUT_S, max_threads: int = NODE_MAX_THREADS):
        self.address_family = socket.getaddrinfo(*address, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0][0]
        self.timeout_s = timeout_s
        self._slots = threading.BoundedSemaphore(max_threads)
        handler = type("NodeScrapeHandler", (_ScrapeHandler,),
                       {"registry": registry, "tokens": tuple(tokens), "timeout": timeout_s})
        super().__init__(address, handler)

    def process_request(self, request, client_address) -> None:
        if not self._slots.acquire(blocking=False):  # every thread busy: refuse rather than queue
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)  # its thread releases the slot
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request, client_address) -> None:
        deadline = threading.Timer(self.timeout_s, _cut, (request,))  # socket timeouts bound one read, not all
        deadline.daemon = True
        deadline.start()
        try:
            super().process_request_thread(request, client_address)
        finally:
            deadline.cancel()
            self._slots.release()

    def handle_error(self, request, client_address) -> None:
        log.debug("node metrics: a scrape from %s failed", client_address, exc_info=True)


def _cut(sock: socket.socket) -> None:
    """Wake whatever reads or writes ``sock`` (it then sees the connection closed)."""
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:  # closed already
        pass


def hold_node_port(path: str, address: tuple[str, int], retry_s: float = NODE_RETRY_S) -> NodeExporter | None:
    """Serve ``path`` (a node's metrics directory) on ``address`` once this process can listen
    there: try every ``retry_s`` while another process of the node holds it. Returns the exporter
    once listening (a daemon thread serves it on), or None without listening where the address
    is off loopback and no token is set (logged as an error)."""
    try:
        tokens = exporter_tokens(address[0])
    except ValueError as exc:
        log.error("node metrics: not listening on %s:%d: %s (set %s in the node's environment, or "
                  "listen on 127.0.0.1)", *address, exc, NODE_TOKENS_ENV)
        return None
    registry = _node_registry(path)
    while True:
        try:
            server = NodeExporter(address, registry, tokens)
            break
        except OSError:  # the port is another replica's (or not ours to take): wait for it
            time.sleep(retry_s)
    threading.Thread(target=server.serve_forever, name="node-metrics-server", daemon=True).start()
    return server


_node_thread: threading.Thread | None = None


def serve_node_metrics() -> threading.Thread | None:
    """Make this replica process one of its node's candidates to serve the node's metrics (a
    daemon thread; once per process). Nothing without a metrics directory or with ``off``."""
    global _node_thread
    path, address = os.environ.get(MULTIPROC_ENV), node_metrics_address()
    if not path or address is None or _node_thread is not None:
        return _node_thread
    _node_thread = threading.Thread(target=hold_node_port, args=(path, address), name="node-metrics", daemon=True)
    _node_thread.start()
    return _node_thread


def watch_gpu_memory(deployment: str, period_s: float = 5.0) -> threading.Thread | None:
    """Keep this process's GPU gauges current (a daemon thread): memory from the allocator's
    counters (no device sync) and, where NVML is there, the device's utilisation. Nothing where
    CUDA was never used: the series are absent, not zero."""
    import torch

    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return None
    nvml = nvml_device(torch.cuda.current_device())

    def refresh() -> None:
        while True:
            GPU_MEMORY.labels(deployment=deployment, kind="reserved").set(torch.cuda.memory_reserved())
            GPU_MEMORY.labels(deployment=deployment, kind="peak_reserved").set(torch.cuda.max_memory_reserved())
            if nvml is not None:
                GPU_UTILIZATION.labels(deployment=deployment).set(gpu_utilization(*nvml))
            time.sleep(period_s)

    thread = threading.Thread(target=refresh, name="gpu-memory", daemon=True)
    thread.start()
    return thread


def nvml_device(index: int, visible: str | None = None):
    """(pynvml, handle) of this process's CUDA device ``index`` (as CUDA_VISIBLE_DEVICES, which Ray
    sets per replica, numbers it), or None where NVML is not installed or finds no GPU."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:  # noqa: BLE001 - no nvidia-ml-py, or no driver: no utilisation series
        return None
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "") if visible is None else visible
    ids = [v.strip() for v in visible.split(",") if v.strip()]
    try:
        if index < len(ids):
            dev = ids[index]
            handle = pynvml.nvmlDeviceGetHandleByIndex(int(dev)) if dev.isdigit() else \
                pynvml.nvmlDeviceGetHandleByUUID(dev)
        else:
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
    except Exception:  # noqa: BLE001
        log.warning("GPU utilisation: NVML does not find CUDA device %d (CUDA_VISIBLE_DEVICES=%r)", index, visible)
        return None
    return pynvml, handle


def gpu_utilization(pynvml, handle) -> float:
    """The device's utilisation now, 0 to 1 (NVML's percentage of its last sample period)."""
    return pynvml.nvmlDeviceGetUtilizationRates(handle).gpu / 100.0


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
    this user's alone (``pipeline.runtime.private_dir``; NotPrivate stops the start, naming the fix)."""
    ensure_private_dir(path)
    for name in os.listdir(path):
        if name.endswith(".db"):
            os.remove(os.path.join(path, name))
