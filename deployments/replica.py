"""What every model deployment shares: threads from its CPU share, one inference thread,
load and warm-up on that thread before the replica reports healthy, and (with ``compile: true``)
a compile cache on disk so that a new replica of a node starts warm (pipeline/runtime/compile_cache.py)."""
from __future__ import annotations

import logging
import time
from typing import Any, Callable

import ray

from pipeline import metrics
from pipeline.runtime.compile_cache import warm_start
from pipeline.runtime.compile_guard import COUNTER
from pipeline.runtime.threads import InferenceThread, keep_large_allocations, pin_torch_threads, threads_for_cpu_share

log = logging.getLogger("ray.serve")


def replica_cpu_share() -> float:
    try:
        return float(ray.get_runtime_context().get_assigned_resources().get("CPU", 1.0))
    except Exception:  # noqa: BLE001 - outside a Ray worker
        return 1.0


class ModelReplica:
    """Mixin: ``self.thread`` runs every model call; ``self.engine`` is loaded and warm."""

    thread: InferenceThread
    engine: Any

    def start_engine(self, name: str, cfg: Any, load: Callable[[Any], Any]) -> None:
        """Load and warm ``load(cfg)`` on this replica's inference thread; a configuration with
        ``compile=True`` goes through its compile cache (a warm cache compiles no graph)."""
        metrics.serve_node_metrics()  # one replica of the node serves its metrics (pipeline/metrics.py)
        threads = threads_for_cpu_share(replica_cpu_share())
        pin_torch_threads(threads)  # the process default, before any torch work
        keep_large_allocations()  # no page faults on each step's big temporaries
        self.thread = InferenceThread(name, threads)
        t0 = time.perf_counter()
        compiles = metrics.COMPILES_AFTER_WARMUP.labels(deployment=name)
        compiles.inc(0)  # exported as 0 from the start
        COUNTER.install().on_compile_after_warmup(compiles.inc)
        # Load and warm on the thread that will serve: per-thread caches get filled there.
        self.engine = self.thread.call(warm_start(name, cfg, lambda: load(cfg)))
        COUNTER.mark_warm()
        metrics.watch_gpu_memory(name)  # GPU replicas: voice_gpu_memory_bytes
        log.info("%s ready in %.1f s (%d torch thread(s))", name, time.perf_counter() - t0, threads)

    async def ready(self) -> bool:
        """Answered only once the constructor (load + warm-up) has finished."""
        return True
