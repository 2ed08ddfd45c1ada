"""Many TTS streams in one engine: batch invariance, slots, waiting, and static shapes under
continuous batching (tiny profile, CPU)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from pipeline.audio_constants import CODEC_FRAME_SAMPLES
from pipeline.runtime.compile_guard import CompileCounter
from pipeline.tts.config import TTSConfig
from pipeline.tts.engine import TTSBusyError, TTSEngine

torch.set_num_threads(1)

TEXTS = {"a": "Hello there, how are you doing today?", "b": "The weather is fine.",
         "c": "This one will be cancelled halfway through.", "d": "Fourth stream, joining late."}
SEEDS = {"a": 11, "b": 12, "c": 13, "d": 14}


def _drain(s) -> np.ndarray:
    out = []
    while (item := s.take()) is not None:
        out.append(item[0])
    return np.concatenate(out) if out else np.zeros(0, np.int16)


def _alone(engine: TTSEngine, name: str, **kw) -> tuple[np.ndarray, np.ndarray]:
    s = engine.stream(TEXTS[name], seed=SEEDS[name], **kw)
    pcm = np.concatenate(list(s))
    return s.codes, pcm


def _in_a_batch(engine: TTSEngine, **kw) -> dict:
    """a starts; b joins at step 3; c at step 5 and is cancelled after 7 frames; d joins after
    that, on c's freed slot. Returns each stream's (codes, pcm) and the batch widths stepped."""
    widths = []
    frame = engine.fns["frame"]

    def spy(*args):
        widths.append(args[0].shape[0])
        return frame(*args)

    engine.fns["frame"] = spy
    try:
        streams = {"a": engine.stream(TEXTS["a"], seed=SEEDS["a"], **kw)}
        pcm = {k: [] for k in TEXTS}
        step = 0
        while step < 400 and (len(streams) < 4 or not all(s.finished for s in streams.values())):
            if step == 3:
                streams["b"] = engine.stream(TEXTS["b"], seed=SEEDS["b"], **kw)
            if step == 5:
                streams["c"] = engine.stream(TEXTS["c"], seed=SEEDS["c"], **kw)
            c = streams.get("c")
            if c is not None and not c.closed and c.generated >= 7:
                slot = c.row
                c.close()  # mid-clause
                assert c.row is None and engine._rows[slot] is None  # freed at once, before the next step
                streams["d"] = engine.stream(TEXTS["d"], seed=SEEDS["d"], **kw)
            engine.step()
            for k, s in streams.items():
                pcm[k].append(_drain(s))
            step += 1
    finally:
        engine.fns["frame"] = frame
    assert engine.active_requests == 0
    return {k: (s.codes, np.concatenate(pcm[k])) for k, s in streams.items()}, widths


def test_batch_invariance_at_one_width():
    """Same seed, alone or beside three other streams that join at different steps (one cancelled
    mid-clause, its slot reused): identical codes, and the same audio."""
    engine = TTSEngine(TTSConfig.tiny(max_frames=40, max_seq_len=256, num_slots=4, batch_widths=(4,)))
    alone = {k: _alone(engine, k) for k in ("a", "b", "d")}
    together, widths = _in_a_batch(engine)
    assert set(widths) == {4}
    for k in ("a", "b", "d"):
        codes, pcm = together[k]
        assert len(codes) > 10
        np.testing.assert_array_equal(codes, alone[k][0], err_msg=k)
        assert np.abs(pcm.astype(np.int32) - alone[k][1]).max() <= 4, k  # decoded in a batch of 4 vs alone
    assert 0 < len(together["c"][0]) < len(alone["a"][0])  # c really stopped early


def test_greedy_streams_equal_alone_across_batch_widths():
    """With the default widths the step's width changes as streams come and go; greedy codes stay
    those of the stream alone (sampled ones may differ by a float-rounding tie: engine docstring)."""
    engine = TTSEngine(TTSConfig.tiny(max_frames=40, max_seq_len=256, num_slots=4))
    assert engine.batch_widths == (1, 2, 4)
    alone = {k: _alone(engine, k, temperature=0.0) for k in ("a", "b", "d")}
    together, widths = _in_a_batch(engine, temperature=0.0)
    assert {1, 2, 4} <= set(widths)
    for k in ("a", "b", "d"):
        np.testing.assert_array_equal(together[k][0], alone[k][0], err_msg=k)


def test_streams_wait_for_a_slot_and_a_full_line_is_refused():
    engine = TTSEngine(TTSConfig.tiny(max_frames=12, max_seq_len=128, num_slots=2, max_waiting=2))
    s = [engine.stream(f"stream number {i}") for i in range(2)]
    engine.step()
    engine.step()  # one joins per step
    s += [engine.stream(f"stream number {i}") for i in range(2, 4)]
    with pytest.raises(TTSBusyError):
        engine.stream("one too many")
    engine.step()
    assert [x.row for x in s] == [0, 1, None, None]  # two slots, two waiting
    s[0].close()
    s[2].close()  # a waiting stream leaves the line
    engine.step()
    assert s[3].row == 0 and engine.active_requests == 2
    for x in (s[1], s[3]):
        assert sum(len(c) for c in x) == x.max_frames * CODEC_FRAME_SAMPLES
    assert engine.active_requests == 0


def test_widths_change_every_step_and_nothing_compiles_after_warmup():
    """Compiled frame step (aot_eager: dynamo's tracing and guards, no codegen) with the stance that
    raises on any recompile: streams join and leave so the batch width changes step after step."""
    counter = CompileCounter().install()
    cfg = TTSConfig.tiny(max_frames=10, max_seq_len=128, prefill_buckets=(64, 128), encode_buckets=(13,),
                         num_slots=4, compile=True, compile_backend="aot_eager",
                         stance_after_warmup="fail_on_recompile")
    engine = TTSEngine(cfg)
    try:
        engine.warmup()
        compiled = counter.total
        graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        widths = []
        frame = engine.fns["frame"]

        def spy(*args):
            widths.append(args[0].shape[0])
            return frame(*args)

        engine.fns["frame"] = spy
        rng = np.random.default_rng(0)
        open_streams = []
        for i in range(40):
            if rng.random() < 0.5 and len(open_streams) < 6:
                open_streams.append(engine.stream(" ".join(["word"] * int(rng.integers(1, 4))), max_frames=int(rng.integers(2, 9))))
            if open_streams and rng.random() < 0.15:
                open_streams.pop(int(rng.integers(len(open_streams)))).close()
            engine.step()
            for s in open_streams:
                _drain(s)
            open_streams = [s for s in open_streams if not s.finished]
        engine.fns["frame"] = frame
        changes = sum(a != b for a, b in zip(widths, widths[1:]))
        assert set(widths) == {1, 2, 4} and changes >= 4, widths
        with torch.inference_mode():  # as step() runs it
            for width in [1, 4, 2, 4, 1, 2, 1, 4]:  # and a width change at every step
                engine.decode(engine.generate(width), width)
        assert counter.total == compiled
        assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs
        assert engine.stats()["unseen_shape_calls"] == 0
    finally:
        torch.compiler.set_stance("default")  # process-wide: leave other tests alone


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device (run by load/gpu_device.sh)")
def test_frame_step_from_cuda_graphs_equals_the_eager_step():
    """frame_graphs: the step replayed from one CUDA graph per width gives the eager engine's codes,
    stream for stream, while streams join, one is cancelled and the width changes; every frame step
    after warm-up is a replay (no capture), and the greedy stream alone matches too."""
    cfg = dict(device="cuda", max_frames=40, max_seq_len=256, num_slots=4)
    eager, graphed = TTSEngine(TTSConfig.tiny(**cfg)), TTSEngine(TTSConfig.tiny(frame_graphs=True, **cfg))
    for e in (eager, graphed):
        e.warmup()
    captured = dict(graphed.fns["frame"].compiled.graphs)
    assert len(captured) == len(graphed.batch_widths) == 3
    want, _ = _in_a_batch(eager, temperature=0.0)
    got, widths = _in_a_batch(graphed, temperature=0.0)
    assert {1, 2, 4} <= set(widths)
    assert graphed.fns["frame"].compiled.graphs == captured  # replays only
    assert graphed.stats()["unseen_shape_calls"] == 0
    for k in want:
        np.testing.assert_array_equal(got[k][0], want[k][0], err_msg=k)
    np.testing.assert_array_equal(_alone(graphed, "a", temperature=0.0)[0], _alone(eager, "a", temperature=0.0)[0])


def test_frame_graphs_need_cuda_and_exclude_compile():
    with pytest.raises(ValueError, match="CUDA"):
        TTSConfig.tiny(frame_graphs=True)
    with pytest.raises(ValueError, match="choose one"):
        TTSConfig.tiny(frame_graphs=True, compile=True, device="cuda")


def test_compile_fns_chooses_what_compiles():
    """compile_fns: only the named gated functions get a compiled path (a CPU compiles the step alone)."""
    engine = TTSEngine(TTSConfig.tiny(max_frames=10, max_seq_len=128, num_slots=2, compile=True,
                                      compile_backend="aot_eager", compile_fns=("frame",)))
    assert engine.fns["frame"].compiled is not None
    assert engine.fns["prefill"].compiled is None and engine.fns["encode"].compiled is None
    everything = TTSEngine(TTSConfig.tiny(max_frames=10, max_seq_len=128, num_slots=2, compile=True,
                                          compile_backend="aot_eager"))
    assert all(everything.fns[n].compiled is not None for n in ("frame", "prefill", "encode"))
    with pytest.raises(ValueError, match="compile_fns"):
        TTSConfig.tiny(compile_fns=("frame", "decode"))
