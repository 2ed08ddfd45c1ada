"""Functions with a closed set of input shapes: optionally compiled, gated, timed.

A compiled function that meets a new input shape (or stride, dtype, specialized scalar) retraces
and recompiles: seconds on a GPU, minutes for full-size Mimi on a CPU. ``ShapeGate`` records the
input signatures seen during warm-up; once :meth:`ShapeGate.seal` is called, a signature not seen
is never handed to the compiled function: it is counted (``unseen_calls``), logged, and run
eagerly. So no input the warm-up did not cover can reach torch.compile, whatever its stance.
Every call slower than ``slow_ms`` (after warm-up) is logged with its shapes (``slow_calls``).
"""
from __future__ import annotations

import logging
import time
from typing import Any, Callable

import torch

log = logging.getLogger(__name__)


def signature(args: tuple, strides: bool = True) -> tuple:
    """What a dynamo guard on these inputs would look at: tensor sizes, strides, dtype, device;
    the value of a Python scalar (specialized into the graph). ``strides=False`` for eager
    functions, where only the shape matters (e.g. a per-shape kernel choice)."""
    out: list[Any] = []
    for a in args:
        if isinstance(a, torch.Tensor):
            out.append((tuple(a.shape), a.stride() if strides else None, a.dtype, a.device.type))
        elif a is None or isinstance(a, (bool, int, float, str)):
            out.append(a)
        else:
            out.append(type(a).__name__)
    return tuple(out)


def shapes(args: tuple) -> str:
    return ", ".join(str(tuple(a.shape)) if isinstance(a, torch.Tensor) else repr(a) for a in args)


class ShapeGate:
    """One function of the engine (a frame step, an encode, a decode) behind a gate on its input
    signatures: compiled or eager, sealed after warm-up, counting unseen and slow calls."""

    def __init__(self, name: str, fn: Callable, compiled: Callable | None = None, slow_ms: float = 200.0,
                 before_call: Callable[[], None] | None = None):
        self.name, self.fn, self.compiled = name, fn, compiled
        self.slow_ms = slow_ms
        self.before_call = before_call  # e.g. cudagraph_mark_step_begin for CUDA-graph trees
        self.seen: set[tuple] = set()
        self.sealed = False
        self.force_eager = False  # warm-up's eager pass
        self.calls = self.unseen_calls = self.slow_calls = 0

    def seal(self) -> None:
        """Warm-up is over: from now on only signatures seen so far may use the compiled function."""
        self.sealed = True

    def __call__(self, *args):
        key = signature(args, strides=self.compiled is not None)
        fn = self.fn if (self.compiled is None or self.force_eager) else self.compiled
        if not self.sealed:
            self.seen.add(key)
        elif key not in self.seen:
            self.unseen_calls += 1
            log.warning("%s: input shapes not covered by warm-up (%s): running eagerly", self.name, shapes(args))
            fn = self.fn
        if fn is self.compiled and self.before_call is not None:
            self.before_call()
        t0 = time.perf_counter()
        out = fn(*args)
        ms = (time.perf_counter() - t0) * 1000
        self.calls += 1
        if self.sealed and ms > self.slow_ms:
            self.slow_calls += 1
            log.warning("slow %s: %.0f ms (threshold %.0f ms), inputs %s", self.name, ms, self.slow_ms, shapes(args))
        return out
