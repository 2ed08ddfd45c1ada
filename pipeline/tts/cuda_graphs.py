"""A fixed-shape function replayed from CUDA graphs: one graph per input signature.

The TTS frame step is launch-bound on a GPU: thousands of small kernels per 80 ms frame (the
backbone, then 31 sequential depth steps), each costing more to launch than to run (docs/gpu.md).
A CUDA graph records those launches once and replays them with one call. The step qualifies:
its shapes are static per batch width, it never syncs with the host, its sampling noise is an
input, and the KV caches it writes are module buffers at fixed addresses.

:class:`GraphedFunction` wraps such a function. The first call with a new input signature copies
the inputs into static buffers, runs the function a few times on a side stream (kernel choices,
lazy allocations), captures one run into a graph with its own memory pool, and keeps it. Every
call then copies the inputs into that graph's buffers, replays it, and returns a copy of its
output (the next replay would overwrite the graph's own). Side effects on module state (the KV
cache writes) happen on every replay exactly as in the eager function.

Inputs that are not tensors (``None``, ints) are part of the signature and must be what the graph
was captured with. This is torch.compile's ``mode="reduce-overhead"`` without inductor: no code
generation, so a capture costs a few eager runs (milliseconds), not a compile (minutes).
"""
from __future__ import annotations

from typing import Callable

import torch

from pipeline.tts.shape_gate import signature


class _Graph:
    def __init__(self, fn: Callable, args: tuple, warmup_runs: int):
        self.inputs = tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in args)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(warmup_runs):
                fn(*self.inputs)
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.output = fn(*self.inputs)

    def __call__(self, args: tuple) -> torch.Tensor:
        for buf, a in zip(self.inputs, args):
            if isinstance(buf, torch.Tensor):
                buf.copy_(a)
        self.graph.replay()
        return self.output.clone()


class GraphedFunction:
    """``fn`` (tensors in, one tensor out, no host sync) replayed from one CUDA graph per signature."""

    def __init__(self, fn: Callable, warmup_runs: int = 2):
        self.fn = fn
        self.warmup_runs = warmup_runs
        self.graphs: dict[tuple, _Graph] = {}

    def __call__(self, *args) -> torch.Tensor:
        key = signature(args)
        graph = self.graphs.get(key)
        if graph is None:
            graph = self.graphs[key] = _Graph(self.fn, args, self.warmup_runs)
        return graph(args)
