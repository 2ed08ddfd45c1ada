"""Warm-up of the TTS engine: every shape of its serving path, on the serving thread, before it
serves; then its gates are sealed (docs/stall.md)."""
from __future__ import annotations

import logging
import time

import numpy as np
import torch

from pipeline.audio_constants import CODEC_FRAME_SAMPLES, USER_RATE

log = logging.getLogger(__name__)


@torch.inference_mode()
def run_every_shape(engine) -> None:
    cfg, k, encoder = engine.cfg, engine.num_codebooks, engine.encoder
    for b in encoder.buckets:  # each encode bucket, then the streaming path (2 pieces)
        encoder.encode_wave(np.zeros(b * CODEC_FRAME_SAMPLES, dtype=np.float32))
    encoder.encode_wave(np.zeros(encoder.buckets[-1] * CODEC_FRAME_SAMPLES + 1, dtype=np.float32))
    encoder.encode_user_audio(np.zeros(USER_RATE // 10, dtype=np.int16))  # and the user path (resample)
    for b in engine.prefill_buckets:  # each prefill bucket (into the last row: it is free now)
        tokens = np.zeros((b, k + 1), dtype=np.int64)
        mask = np.zeros((b, k + 1), dtype=bool)
        mask[:, k] = True
        engine.prefill(tokens, mask, engine.num_slots - 1)
    for width in engine.batch_widths:  # the frame step at every width
        engine.generate(width)
    engine.decode(engine.row_codes[: engine.batch_widths[-1]], engine.batch_widths[-1])
    engine.decoder.reset(torch.ones(engine.num_slots, dtype=torch.bool, device=engine.device))
    streams = [engine.stream("Hello there.", max_frames=cfg.first_chunk_frames + cfg.chunk_frames)
               for _ in range(min(2, engine.num_slots))]
    for s in streams:  # and the whole path once, as requests run it (two streams joining)
        for _ in s:
            pass


def warm(engine) -> None:
    """Run every shape of the serving path on THIS thread (call it on the serving thread: some
    caches are per thread). With ``compile``: an eager pass first (Mimi's quantizer builds its
    tables on first use, so a compile before it would be traced twice), then the compiled pass.
    Then the gates are sealed, the voices' clips encoded, and torch's compiler stance set to
    ``cfg.stance_after_warmup``."""
    cfg, fns = engine.cfg, engine.fns.values()
    passes = (True, False) if cfg.compile or cfg.frame_graphs else (True,)
    t0 = time.perf_counter()
    try:  # under torch's default stance: one left by another engine of this process could skip compiles
        with torch.compiler.set_stance("default"):
            for eager in passes:
                for f in fns:
                    f.force_eager = eager
                run_every_shape(engine)
    finally:
        for f in fns:
            f.force_eager = False
    for f in fns:
        f.seal()
    engine.voices.encode_clips(engine.encoder.encode_audio)  # after sealing: a clip needing a new shape would count
    engine.warm = True
    if cfg.compile and cfg.stance_after_warmup != "default":
        torch.compiler.set_stance(cfg.stance_after_warmup)
    log.info("TTS warm in %.1f s: %d slots, batch widths %s, prefill buckets %s, encode buckets %s frames, "
             "compile=%s", time.perf_counter() - t0, engine.num_slots, engine.batch_widths, engine.prefill_buckets,
             engine.encoder.buckets, cfg.compile)
