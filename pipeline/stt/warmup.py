"""Warm-up of the recogniser: every shape its step runs with, before it serves."""
from __future__ import annotations

import numpy as np
import torch


def warm(engine) -> None:
    """Run every shape the engine steps with (each batch width; first/later/last chunks).

    Call before serving: with ``cfg.compile`` this compiles one graph per batch width, and
    then sets torch's compiler stance to ``cfg.stance_after_warmup``, so that nothing compiles
    later. It runs under the default stance whatever another engine of this process set (a
    stance that stops recompiles would leave all widths but the first uncompiled). It uses
    (and then resets) all slots, so no stream may be open.
    """
    if engine.active_streams:
        raise RuntimeError("STTEngine.warmup() must run before any stream is opened")
    if not engine.cfg.compile:
        _run_every_width(engine)
        return
    with torch.compiler.set_stance("default"):
        _run_every_width(engine)
    if engine.cfg.stance_after_warmup != "default":
        torch.compiler.set_stance(engine.cfg.stance_after_warmup)


def _run_every_width(engine) -> None:
    rng, f = np.random.default_rng(0), engine.framing
    need = (f.n_first + f.n_next - 1) * f.hop + 2 * f.hop
    try:
        for width in range(1, engine.num_slots + 1):
            ids = [f"__warmup{i}" for i in range(width)]
            for sid in ids:
                engine.open(sid)
                engine.feed(sid, 0.01 * rng.standard_normal(need).astype(np.float32))
            engine.step()  # first chunks
            engine.step()  # later chunks
            engine.end(ids[0])
            while engine.pending():
                engine.step()  # a last chunk
            for sid in ids:
                engine.close(sid)
    finally:
        engine.reset()
