"""Counting compilations, so that "nothing compiles after warm-up" is a number, not a hope.

A compile on the serving path is the CPU/GPU form of the turn-boundary stall (a compiled
function meeting a new shape retraces for seconds to minutes). Each model replica installs
one :class:`CompileCounter`, marks the end of its warm-up, and exports the count of later
compilations as ``voice_compiles_after_warmup_total``.
"""
from __future__ import annotations

import logging
import threading
from typing import Callable

log = logging.getLogger(__name__)


class CompileCounter:
    """Counts torch.compile traces (and CUDA-graph recordings) of this process."""

    def __init__(self) -> None:
        self.total = 0
        self.after_warmup = 0
        self.warm = False
        self._listeners: list[Callable[[], None]] = []
        self._lock = threading.Lock()
        self._installed = False

    def install(self) -> "CompileCounter":
        if not self._installed:
            from torch._dynamo.callback import on_compile_start

            on_compile_start(self._on_compile_start)
            self._installed = True
        return self

    def on_compile_after_warmup(self, fn: Callable[[], None]) -> None:
        self._listeners.append(fn)

    def mark_warm(self) -> None:
        """Warm-up is over: every later compilation counts as a stall risk."""
        with self._lock:
            self.warm = True

    def _on_compile_start(self, args) -> None:
        with self._lock:
            self.total += 1
            if not self.warm:
                return
            self.after_warmup += 1
        log.warning("compilation after warm-up (%s, id %s)", args.callback_trigger.name, args.compile_id)
        for fn in self._listeners:
            fn()


COUNTER = CompileCounter()
