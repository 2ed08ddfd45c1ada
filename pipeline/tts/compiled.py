"""The TTS engine's tensor functions on the serving path, each behind a :class:`ShapeGate`: compiled
(``cfg.compile``: one cache entry per bucket or width, so dynamo is told to keep them all), captured
as a CUDA graph (the frame step with ``cfg.frame_graphs``), or eager."""
from __future__ import annotations

from typing import Callable

import torch

from pipeline.tts.config import TTSConfig
from pipeline.tts.cuda_graphs import GraphedFunction
from pipeline.tts.shape_gate import ShapeGate


def gated_functions(cfg: TTSConfig, device: torch.device, shapes: int,
                    fns: dict[str, tuple[Callable, bool, bool]]) -> dict[str, ShapeGate]:
    """``fns``: name -> (function, fullgraph, may be compiled); ``shapes``: the most shapes one of
    them runs with (its buckets or widths)."""
    mode = cfg.compile_mode
    if mode is None and device.type == "cuda":
        mode = "reduce-overhead"  # CUDA graphs: static inputs are the step buffers and caches
    before = torch.compiler.cudagraph_mark_step_begin if cfg.compile and mode == "reduce-overhead" else None
    if cfg.compile:  # one cache entry per bucket / width: make sure dynamo keeps them all
        for name in ("recompile_limit", "cache_size_limit"):
            if hasattr(torch._dynamo.config, name) and getattr(torch._dynamo.config, name) < shapes + 2:
                setattr(torch._dynamo.config, name, shapes + 2)

    def compiled(name: str, fn: Callable, fullgraph: bool):
        if cfg.frame_graphs and name == "frame":  # captured, not compiled
            return GraphedFunction(fn)
        if not cfg.compile or name not in cfg.compile_fns:
            return None
        kw: dict = dict(dynamic=False, fullgraph=fullgraph, backend=cfg.compile_backend)
        if mode and cfg.compile_backend == "inductor":
            kw["mode"] = mode
        return torch.compile(fn, **kw)

    return {name: ShapeGate(name, fn, compiled(name, fn, fullgraph) if may_compile else None, cfg.slow_step_ms,
                            before)
            for name, (fn, fullgraph, may_compile) in fns.items()}
