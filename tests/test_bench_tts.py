"""The benchmark tools' own logic (load/bench_tts.py, load/repro_stall.py): the noise rule for
ratios, what a child process is told, and that the seed-faithful path does what docs/stall.md
says the stalled agent did (raw-length compiled prefill, eager re-encode every turn)."""
from __future__ import annotations

import torch

from load import bench_tts, isolated_runs, repro_stall
from pipeline.audio_constants import CODEC_FRAME_SAMPLES


def test_paired_reports_only_ratios_above_noise():
    big = isolated_runs.paired([1000.0, 1200.0, 900.0], [10.0, 11.0, 12.0])
    assert big["median"] is not None and not big["within_noise"] and big["median"] > 50
    same = isolated_runs.paired([100.0, 130.0, 95.0], [110.0, 100.0, 120.0])
    assert same["median"] is None and same["within_noise"] and len(same["ratios"]) == 3
    # a consistent 1.5x is still noise when one side spreads 2x over the repeats
    spread = isolated_runs.paired([150.0, 300.0, 160.0], [100.0, 200.0, 105.0])
    assert spread["median"] is None and spread["band"] >= 2.0
    # faster beyond the band counts too (ratio below 1 / band)
    fast = isolated_runs.paired([1.0, 1.1, 1.0], [10.0, 10.5, 11.0])
    assert fast["median"] is not None and fast["median"] < 0.2


def test_med_range_skips_missing_values():
    assert isolated_runs.med_range([3.0, None, 1.0, 2.0]) == {"median": 2.0, "min": 1.0, "max": 3.0}
    assert isolated_runs.med_range([None]) == {"median": None, "min": None, "max": None}


def test_child_gets_the_parents_settings():
    args = bench_tts.parse_args(["--backend", "aot_eager", "--turns", "2", "--max-seq-len", "128",
                                 "--ref-seconds", "1.5", "--context-segments", "2", "--no-naive"])
    assert args.paths == ["ours", "seed"]
    child = bench_tts.parse_args(["--path", "seed", *bench_tts.child_argv(args)])
    for k in bench_tts.FORWARD:
        assert getattr(child, k) == getattr(args, k), k
    assert child.path == "seed"


def test_repro_stall_buckets():
    fs = CODEC_FRAME_SAMPLES
    assert repro_stall.padded(1, [25, 50]) == 25 * fs
    assert repro_stall.padded(25 * fs + 1, [25, 50]) == 50 * fs
    assert repro_stall.padded(int(1.37 * 24_000), [25, 50, 100]) == 25 * fs


def test_seed_path_compiles_each_new_prompt_length_and_reencodes():
    torch.set_num_threads(1)
    args = bench_tts.parse_args(["--path", "seed", "--backend", "aot_eager", "--turns", "3", "--max-seq-len", "256",
                                 "--max-frames", "3", "--ref-seconds", "0.5", "--context-segments", "2"])
    try:
        r = bench_tts.run_path(args)
    finally:
        torch.compiler.set_stance("default")
    rows = r["prompt_rows"]
    assert len(set(rows)) == 3  # three prompt lengths never seen at warm-up...
    assert r["compiles_after_warmup"] == 3  # ...each compiled the raw-length prefill once
    assert r["prefill_buckets"] == "raw lengths" and r["encode_buckets"] == "raw lengths"
    assert r["unseen_shape_calls"] == 0  # the frame step stayed on its warmed shape
