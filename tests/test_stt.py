"""Streaming recogniser engine (pipeline/stt) on the tiny random-weight cache-aware FastConformer RNNT."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from pipeline.audio import formant_speech
from pipeline.stt.calibration import set_blank_bias
from pipeline.stt.config import STTConfig
from pipeline.stt.engine import NoFreeSlot, STTEngine
from pipeline.stt.model import build_tiny_model
from pipeline.stt.reference import offline_tokens

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    cfg = STTConfig.tiny(num_slots=4, cache_dir=str(tmp_path_factory.mktemp("stt_cache")))
    model = build_tiny_model(cfg)
    return cfg, model


def _engine(tiny, **kw) -> STTEngine:
    cfg, model = tiny
    fields = {**cfg.__dict__, **kw}
    return STTEngine(model, STTConfig(**fields))


def _final(engine, sid):
    """End ``sid``'s utterance and step until its "final" event (``sid`` is the only stream with audio)."""
    engine.end(sid)
    finals = []
    while engine.pending():
        finals += [e for e in engine.step() if e.kind == "final"]
    assert [e.stream_id for e in finals] == [sid]
    return finals[0]


def _feed_randomly(engine, audios, rng, *, start_step=None, close_after=None, piece=(200, 9000)):
    """Feed streams in random-size pieces, one engine step per round; returns {id: tokens} of the final.

    A stream whose audio is all fed ends with ``end()``: its last chunk rides in a batched step
    with other streams' chunks and comes back as a "final" event.
    """
    start_step = start_step or {sid: 0 for sid in audios}
    pos = {sid: 0 for sid in audios}
    out, events = {}, []
    for rnd in range(1000):
        for sid, pcm in audios.items():
            if sid in out or rnd < start_step[sid]:
                continue
            if rnd == start_step[sid]:
                engine.open(sid)
            k = int(rng.integers(*piece))
            engine.feed(sid, pcm[pos[sid] : pos[sid] + k])
            pos[sid] += k
        new_events = engine.step()
        events += new_events
        for e in new_events:
            if e.kind == "final":
                out[e.stream_id] = e.tokens
                assert e.text == engine.tokenizer.ids_to_text(e.tokens)
                engine.close(e.stream_id)
        for sid, pcm in audios.items():
            if sid not in out and sid in engine.active_streams and pos[sid] >= len(pcm):
                if not engine._streams[sid].ending:
                    engine.end(sid)
        if close_after and rnd == close_after[0]:
            engine.close(close_after[1])  # a disconnect mid-utterance
            out[close_after[1]] = None
        if len(out) == len(audios):
            return out, events
    raise AssertionError("streams did not finish")


LIBRARY_PATHS = dict(kv_cache=False, fast_subsampling=False, decoder="frame_loop", unrolled_lstm=False)


@pytest.mark.parametrize(
    "att,paths", [([70, 13], {}), ([70, 1], {}), ([70, 13], LIBRARY_PATHS)], ids=["13", "1", "13-library"]
)
def test_streaming_equals_offline(tiny, att, paths):
    """Streaming tokens == an offline pass of the model; with our fast paths and with every one of
    them switched back (NeMo's layer loop, NeMo's masked subsampling, nn.LSTM, and our own
    frame-looping decoder instead of label looping)."""
    from pipeline.stt.decoding import frame_loop_decode_chunk
    from pipeline.stt.encoder import KVCacheLayersStep

    cfg, model = tiny
    engine = _engine(tiny, att_context_size=att, **paths)
    fast = (isinstance(engine.enc_step, KVCacheLayersStep), engine._fast_pre is not None,
            engine._decode_chunk is not frame_loop_decode_chunk, engine.pred.unrolled)
    assert fast == ((False,) * 4 if paths else (True,) * 4)
    rng = np.random.default_rng(1)
    durations = [0.4, 1.13, 2.37, 3.01, 4.55] if att == [70, 13] else [0.3, 1.37, 2.2]
    audios = {f"s{i}": formant_speech(d, seed=10 + i) for i, d in enumerate(durations)}
    got, events = _feed_randomly(engine, dict(list(audios.items())[:4]), rng)
    if len(audios) > 4:  # the fifth reuses a freed slot
        more, ev2 = _feed_randomly(engine, dict(list(audios.items())[4:]), rng)
        got.update(more)
        events += ev2
    total = 0
    for sid, pcm in audios.items():
        ref = offline_tokens(model, pcm)
        assert got[sid] == ref, f"{sid}: streaming {got[sid]} != offline {ref}"
        total += len(ref)
    assert total > 10  # the calibrated model does emit tokens
    assert all(e.kind in ("partial", "endpoint", "final") for e in events)
    assert sorted(e.stream_id for e in events if e.kind == "final") == sorted(audios)  # one final each
    model.encoder.set_default_att_context_size(list(cfg.att_context_size))


def test_batch_invariance_join_leave(tiny):
    rng = np.random.default_rng(2)
    audios = {f"b{i}": formant_speech(d, seed=20 + i) for i, d in enumerate([5.9, 4.7, 6.6, 3.2])}
    alone = {}
    for sid, pcm in audios.items():
        engine = _engine(tiny)
        got, _ = _feed_randomly(engine, {sid: pcm}, np.random.default_rng(5))
        alone[sid] = got[sid]
    engine = _engine(tiny)
    batches = []
    advance = engine._advance
    engine._advance = lambda streams, last: (batches.append((len(streams), sum(last))), advance(streams, last))[1]
    audios["gone"] = formant_speech(5.0, seed=99)
    together, _ = _feed_randomly(
        engine,
        audios,
        rng,
        start_step={"b0": 0, "b1": 1, "b2": 2, "b3": 4, "gone": 0},
        close_after=(2, "gone"),
        piece=(10000, 30000),
    )
    for sid in alone:
        assert together[sid] == alone[sid], sid
    assert engine.active_streams == []
    assert max(w for w, _ in batches) >= 3  # really batched
    assert any(0 < n_last < w for w, n_last in batches)  # a last chunk rode with other streams' chunks


def test_partials_concatenate_to_final(tiny):
    engine = _engine(tiny)
    pcm = formant_speech(3.3, seed=7)
    engine.open("p")
    partials = []
    for i in range(0, len(pcm), 4000):
        engine.feed("p", pcm[i : i + 4000])
        while engine.pending():
            partials += [e.text for e in engine.step() if e.kind == "partial"]
    final = _final(engine, "p").text
    assert len(partials) >= 2 and all(partials), partials  # partials did arrive, each a non-empty delta
    assert final.startswith("".join(partials)), (partials, final)
    assert engine._streams["p"].tokens == []  # reset for a new utterance, slot kept
    assert engine.active_streams == ["p"]


def test_word_timings_from_emission_frames(tiny):
    """Words group SentencePiece pieces at "▁"; times come from the tokens' encoder frames (80 ms)."""
    from pipeline.stt.engine import word_timings

    cfg, model = tiny
    tok = model.tokenizer
    ids = tok.text_to_ids("the quick brown fox")
    pieces = tok.ids_to_tokens(ids)
    # the tiny tokenizer's pieces, words of 1, 5, 4 and 3 pieces (tokens 0 | 1-5 | 6-9 | 10-12)
    assert pieces == ["\u2581the", "\u2581", "q", "u", "i", "ck", "\u2581b", "r", "ow", "n", "\u2581f", "o", "x"]
    frames = [3 * i + 2 for i in range(len(ids))]  # token i on frame 3i + 2: 2, 5, 8, ..., 38
    words = word_timings(tok, ids, frames, 80)
    assert [w["word"] for w in words] == ["the", "quick", "brown", "fox"]
    # by hand: a word starts at its first token's frame and ends where its last token's frame ends,
    # the: frames 2..2 -> 160-240 ms; quick: 5..17 -> 400-1440; brown: 20..29 -> 1600-2400; fox: 32..38 -> 2560-3120
    assert [(w["start_ms"], w["end_ms"]) for w in words] == [(160, 240), (400, 1440), (1600, 2400), (2560, 3120)]
    assert word_timings(tok, [], [], 80) == []


def test_final_words_match_text_and_audio(tiny):
    engine = _engine(tiny)
    pcm = formant_speech(3.7, seed=8)
    engine.open("w")
    engine.feed("w", pcm)
    final = _final(engine, "w")
    text, tokens, words = final.text, final.tokens, final.words
    assert tokens and words
    # the same words and times as NeMo's offline pass, whose decoder records each token's frame
    from pipeline.stt.engine import word_timings
    from pipeline.stt.reference import offline_tokens_and_frames

    ref_tokens, ref_frames = offline_tokens_and_frames(tiny[1], pcm)
    assert len(ref_frames) == len(ref_tokens) and len(set(ref_frames)) > 3  # frames over the utterance
    assert words == word_timings(engine.tokenizer, ref_tokens, ref_frames, 80)
    assert " ".join(w["word"] for w in words) == text.strip()
    assert all(0 <= w["start_ms"] < w["end_ms"] for w in words)
    assert [w["start_ms"] for w in words] == sorted(w["start_ms"] for w in words)
    assert words[-1]["end_ms"] <= len(pcm) / 16 + 80  # within the audio (one frame of rounding)


def test_bfloat16_engine(tiny):
    """dtype bfloat16 (the GPU setting) loads the model in bf16, keeps the slot state in bf16 and the
    audio in float32 up to the features; its streaming tokens match the same bf16 model's offline
    pass (bf16 rounding differs between a chunked and a whole-utterance pass, so not always token
    for token: measured 4 of 6 clips exact, the others 0.90-0.95 similar); unknown dtypes are refused."""
    import difflib

    from pipeline.stt.model import load_model

    cfg, _ = tiny
    bf = STTConfig(**{**cfg.__dict__, "dtype": "bfloat16"})
    m16 = load_model(bf)
    assert {p.dtype for p in m16.parameters()} == {torch.bfloat16}
    engine = STTEngine(m16, bf)
    assert engine.state.caches[0].dtype == engine.state.hc.dtype == torch.bfloat16
    exact, similarity = 0, []
    for seed in range(5, 11):
        pcm = formant_speech(3.0, seed=seed)
        engine.open("b")
        engine.feed("b", pcm)
        final = _final(engine, "b")
        engine.close("b")
        ref = offline_tokens(m16, pcm)
        assert ref and final.text and final.words
        exact += final.tokens == ref
        similarity.append(difflib.SequenceMatcher(a=final.tokens, b=ref).ratio())
    assert exact >= 3 and np.mean(similarity) >= 0.9, (exact, similarity)
    with pytest.raises(ValueError, match="dtype"):
        STTConfig(dtype="int8")


def test_slot_exhaustion_and_close(tiny):
    engine = _engine(tiny, num_slots=2)
    engine.open("a")
    engine.open("b")
    with pytest.raises(NoFreeSlot, match="2 STT slots"):
        engine.open("c")
    engine.feed("a", np.zeros(5000, np.float32))
    engine.close("a")  # no finish: a disconnect
    engine.open("c")
    assert sorted(engine.active_streams) == ["b", "c"]
    engine.close("zzz")  # closing an unknown stream is harmless


def _run_until_endpoint(tiny, endpoint_ms):
    cfg, model = tiny
    engine = _engine(tiny, att_context_size=[70, 1], endpoint_ms=endpoint_ms)  # 160 ms chunks
    pcm = formant_speech(8.0, seed=3)
    engine.open("e")
    hop = 2 * 8 * 160
    fed, muted_at_ms, endpoint_at_ms = 0, None, None
    base = model._gapless_blank_bias
    try:
        engine.feed("e", pcm[: 9 * 160 + 256])
        fed = 9 * 160 + 256
        while fed < len(pcm):
            events = engine.step()
            st = engine._streams["e"]
            if muted_at_ms is None and st.tokens:
                set_blank_bias(model, 1e4)  # from here on the model outputs only blanks
                muted_at_ms = (st.last_token_frame + 1) * 80
            if any(e.kind == "endpoint" for e in events):
                endpoint_at_ms = st.enc_frames * 80
                break
            engine.feed("e", pcm[fed : fed + hop])
            fed += hop
    finally:
        set_blank_bias(model, base)
        model.encoder.set_default_att_context_size(list(cfg.att_context_size))
    assert muted_at_ms is not None
    return muted_at_ms, endpoint_at_ms


def test_endpoint_after_trailing_blanks(tiny):
    muted, ep = _run_until_endpoint(tiny, 800)
    assert ep is not None
    assert 800 <= ep - muted < 800 + 160 + 80, (muted, ep)


def test_no_endpoint_when_disabled(tiny):
    _, ep = _run_until_endpoint(tiny, None)
    assert ep is None


def test_warmup_then_serve(tiny):
    engine = _engine(tiny, num_slots=2)
    engine.warmup()
    assert engine.active_streams == []
    pcm = formant_speech(1.5, seed=4)
    engine.open("w")
    engine.feed("w", pcm)
    assert _final(engine, "w").tokens == offline_tokens(tiny[1], pcm)
    with pytest.raises(RuntimeError):
        engine.warmup()


def test_missing_real_checkpoint_is_a_clear_error(monkeypatch, tmp_path):
    from pipeline.stt.model import load_real_model
    from pipeline.runtime.weights import MissingCheckpointError

    monkeypatch.setenv("HF_HOME", str(tmp_path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv("GAPLESS_ALLOW_DOWNLOAD", raising=False)
    with pytest.raises(MissingCheckpointError, match="STT checkpoint"):
        load_real_model("gapless-test/no-such-stt-model")


def test_real_profile_loads_a_nemo_file(tiny, tmp_path):
    """The real-profile path (ASRModel.restore_from) on a .nemo saved from the tiny model."""
    _, model = tiny
    path = str(tmp_path / "tiny.nemo")
    model.save_to(path)
    engine = STTEngine.from_config(STTConfig.real(model=path, num_slots=2))
    assert engine.model is not model
    pcm = formant_speech(2.5, seed=6)
    engine.open("r")
    engine.feed("r", pcm)
    assert _final(engine, "r").tokens == offline_tokens(model, pcm)


def test_compiled_encoder_no_recompiles(tiny):
    """Inductor, as serve_config.gpu.yaml compiles STT: after warm-up, serving two streams of other
    lengths compiles nothing (the stance would raise) and gives the offline tokens (~25 s here)."""
    from torch._dynamo.utils import counters

    engine = _engine(tiny, num_slots=2, compile=True, stance_after_warmup="fail_on_recompile")
    try:
        engine.warmup()
        graphs = counters["stats"]["unique_graphs"]
        audios = {"c0": formant_speech(2.9, seed=1), "c1": formant_speech(1.3, seed=2)}
        got, _ = _feed_randomly(engine, audios, np.random.default_rng(3), piece=(8000, 20000))
    finally:
        torch.compiler.set_stance("default")
    assert counters["stats"]["unique_graphs"] == graphs
    for sid, pcm in audios.items():
        assert got[sid] == offline_tokens(tiny[1], pcm)


def test_compile_covers_every_batch_width(tiny):
    """More slots (10) than dynamo's default recompile limit (8): warm-up compiles one graph per
    batch width, none left to run eagerly without a word, under the default stance whatever stance
    the process had; then it sets the configured stance. Serving at every width (9 and 10 included;
    first, later and last chunks) compiles nothing more, and a width warm-up had missed raises under
    ``fail_on_recompile``. The "eager" backend traces and guards like inductor, without code
    generation."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()  # compiled entries live on the code object, shared by every engine
    engine = _engine(tiny, num_slots=10, compile=True, compile_backend="eager", stance_after_warmup="fail_on_recompile")
    widths = []
    advance = engine._advance
    engine._advance = lambda streams, last: (widths.append(len(streams)), advance(streams, last))[1]
    rng = np.random.default_rng(4)
    before = counters["stats"]["unique_graphs"]
    try:
        torch.compiler.set_stance("eager_on_recompile")  # as another engine's warm-up in this process leaves it
        engine.warmup()
        warm = counters["stats"]["unique_graphs"]
        assert warm - before == 10
        widths.clear()
        for n in (10, 9, 3):
            audios = {f"{n}-{i}": formant_speech(1.2 + 0.3 * i, seed=50 + i) for i in range(n)}
            # n = 9 in equal pieces: all nine first chunks are due in the same step (width 9)
            piece = (20000, 20001) if n == 9 else (6000, 14000)
            got, _ = _feed_randomly(engine, audios, rng, piece=piece)
            if n == 10:
                for sid in list(audios)[:3]:
                    assert got[sid] == offline_tokens(tiny[1], audios[sid]), sid
        with pytest.raises(RuntimeError, match="fail_on_recompile"):
            _encoder_layers_at_width(engine, 11)  # a width warm-up never ran
    finally:
        torch.compiler.set_stance("default")
    assert {1, 9, 10} <= set(widths)
    assert counters["stats"]["unique_graphs"] == warm


@torch.inference_mode()
def _encoder_layers_at_width(engine: STTEngine, width: int):
    """One call of the engine's (compiled) encoder layers on ``width`` rows of its slot state."""
    idx = torch.arange(width) % engine.num_slots
    T = engine.framing.out_len
    pre = torch.zeros(width, T, engine.enc.d_model)
    pre_len = torch.full((width,), T)
    caches = [cache.index_select(1, idx) for cache in engine.state.caches]
    return engine._layers(pre, pre_len, caches, engine.state.cache_len.index_select(0, idx), pos=engine.enc_step.positions(T))


def test_unrolled_lstm_matches_library(tiny):
    from pipeline.stt.decoding import PredictionStep

    _, model = tiny
    unrolled, library = PredictionStep(model.decoder, True), PredictionStep(model.decoder, False)
    assert unrolled.unrolled and not library.unrolled
    g = torch.Generator().manual_seed(0)
    L, H, B = unrolled.num_layers, unrolled.hidden, 5
    hc = torch.randn(2 * L, B, H, generator=g)
    labels = torch.tensor([0, 3, 17, model.decoder.blank_idx, 100])
    with torch.inference_mode():
        a, b = unrolled(labels, hc), library(labels, hc)
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("max_symbols", [1, 2, 3])
def test_label_looping_equals_frame_looping(tiny, max_symbols):
    """The label-looping decoder (an iteration per label) emits the same labels on the same frames and
    ends in the same prediction state as frame looping (an iteration per frame), rows of different
    lengths in one batch; the blank bias is varied so rows range from silent to emitting every frame."""
    from pipeline.stt.decoding import PredictionStep, frame_loop_decode_chunk, label_loop_decode_chunk

    _, model = tiny
    pred = PredictionStep(model.decoder, True)
    joint, blank = model.joint, model.decoder.blank_idx
    gen = torch.Generator().manual_seed(max_symbols)
    B, T, L, H = 6, 14, pred.num_layers, pred.hidden
    f = torch.randn(B, T, joint.joint_hidden, generator=gen) * 2
    f_len = torch.tensor([14, 0, 9, 14, 1, 5])
    hc = torch.randn(2 * L, B, H, generator=gen)
    g = joint.project_prednet(torch.randn(B, H, generator=gen))
    base = float(_joint_bias(model)[blank])
    seen = set()
    try:
        for bias in (-30.0, -3.0, 0.0, 1.0, 3.0, 30.0):
            _joint_bias(model)[blank] = base + bias
            with torch.inference_mode():
                fl = frame_loop_decode_chunk(joint, pred, blank, max_symbols, f, f_len, g, hc)
                ll = label_loop_decode_chunk(joint, pred, blank, max_symbols, f, f_len, g, hc)
            emitted = lambda out: [
                [(int(lab), int(fr)) for lab, fr in zip(out[0][b], out[1][b]) if lab >= 0] for b in range(B)
            ]
            assert emitted(ll) == emitted(fl), bias
            for x, y in zip(ll[2:], fl[2:]):
                torch.testing.assert_close(x, y, rtol=0, atol=0)
            n = sum(len(r) for r in emitted(fl))
            seen.add(min(n, 1) if n < int(f_len.sum()) * max_symbols else 2)
            assert all(not r for r, n_b in zip(emitted(fl), f_len) if n_b == 0)
    finally:
        _joint_bias(model)[blank] = base
    assert seen == {0, 1, 2}, seen  # silent, some labels, and every frame at max_symbols


def _joint_bias(model) -> torch.Tensor:
    return [m for m in model.joint.joint_net.modules() if isinstance(m, torch.nn.Linear)][-1].bias.data


@torch.inference_mode()
def test_kv_cache_layers_equal_nemo_layers(tiny):
    """Five consecutive steps of the encoder layers with projected K/V caches equal NeMo's layer loop
    with its input caches (outputs on valid frames, conv caches, cache lengths; the K/V caches equal
    NeMo's cached inputs projected), from empty caches on, with a short row and a row joining late."""
    from pipeline.stt.encoder import KVCacheLayersStep, NemoLayersStep

    _, model = tiny
    enc = model.encoder
    kv, ref = KVCacheLayersStep(enc), NemoLayersStep(enc)
    eng = _engine(tiny)
    assert isinstance(eng.enc_step, KVCacheLayersStep)
    assert isinstance(_engine(tiny, kv_cache=False).enc_step, NemoLayersStep)
    B, T, d = 3, eng.framing.out_len, enc.d_model
    gen = torch.Generator().manual_seed(3)
    kv_caches = [torch.zeros((s[0], B, *s[2:])) for s in kv.cache_shapes()]
    ref_caches = [torch.zeros((s[0], B, *s[2:])) for s in ref.cache_shapes()]
    kv_len, ref_len = torch.zeros(B, dtype=torch.long), torch.zeros(B, dtype=torch.long)
    for step in range(5):
        pre = torch.randn(B, T, d, generator=gen)
        pre_len = torch.tensor([T, T if step < 4 else 5, T])
        if step < 2:  # row 2 joins at step 2: reset its caches
            for c in kv_caches + ref_caches:
                c[:, 2] = 0
            kv_len[2] = ref_len[2] = 0
        a, al, kv_caches, kv_len = kv(pre, pre_len, kv_caches, kv_len)
        b, bl, ref_caches, ref_len = ref(pre, pre_len, ref_caches, ref_len)
        assert torch.equal(al, bl) and torch.equal(kv_len, ref_len)
        for row, n in enumerate(bl.tolist()):
            torch.testing.assert_close(a[row, :, :n], b[row, :, :n], rtol=1e-4, atol=1e-5)
        rows = [0, 2] if step == 4 else [0, 1, 2]  # a short (last) chunk's caches are thrown away
        torch.testing.assert_close(kv_caches[2][:, rows], ref_caches[1][:, rows], rtol=1e-4, atol=1e-5)
        for i, layer in enumerate(enc.layers):
            n = int(ref_len.min())
            for mine, lin in ((kv_caches[0], layer.self_attn.linear_k), (kv_caches[1], layer.self_attn.linear_v)):
                want = lin(ref_caches[0][i])
                torch.testing.assert_close(mine[i][rows, -n:], want[rows, -n:], rtol=1e-4, atol=1e-5)
    assert int(ref_len.max()) == eng.enc.streaming_cfg.last_channel_cache_size  # the cache filled up


def _split_last(engine):
    """Make ``engine`` take the old path: last chunks in their own _advance call after the others."""
    advance = engine._advance
    calls = []

    def split(streams, last):
        calls.append((len(streams), sum(last)))
        body = [(s, ls) for s, ls in zip(streams, last) if not ls]
        tail = [(s, ls) for s, ls in zip(streams, last) if ls]
        for part in (body, tail):
            if part:
                advance([s for s, _ in part], [ls for _, ls in part])

    engine._advance = split
    return calls


@pytest.mark.parametrize("framing", ["exact", "nemo"])
def test_mixed_last_batch_equals_split_batch(tiny, framing):
    """A step whose batch mixes last and non-last chunks gives the same tokens, token for token,
    as the old path that decodes the last chunks in a step of their own."""
    audios = {f"m{i}": formant_speech(d, seed=40 + i) for i, d in enumerate([1.3, 4.1, 2.6, 5.2])}

    def run(split: bool):
        engine = _engine(tiny, framing=framing)
        calls = _split_last(engine) if split else None
        mixed = []
        advance = engine._advance
        engine._advance = lambda s, ls: (mixed.append(0 < sum(ls) < len(ls)), advance(s, ls))[1]
        out = {}
        for sid, pcm in audios.items():
            engine.open(sid)
            engine.feed(sid, pcm)
            engine.end(sid)
        while len(out) < len(audios):
            for e in engine.step():
                if e.kind == "final":
                    out[e.stream_id] = e.tokens
                    engine.close(e.stream_id)
        return out, mixed, calls

    together, mixed, _ = run(split=False)
    apart, _, calls = run(split=True)
    assert any(mixed), "no step mixed last and non-last chunks"
    assert any(0 < n_last < n for n, n_last in calls)
    assert together == apart
    assert sum(len(t) for t in together.values()) > 10
    if framing == "exact":
        for sid, pcm in audios.items():
            assert together[sid] == offline_tokens(tiny[1], pcm), sid


@torch.inference_mode()
def test_fast_features_and_pre_encode_match_nemo(tiny):
    """The engine's mel features equal NeMo's preprocessor bit for bit; its channels-last subsampling
    equals NeMo's masked pre-encode on every valid frame to float rounding, with the same lengths,
    also for rows shorter than the batch (the frames past a row's length are don't-care)."""
    cfg, model = tiny
    eng = _engine(tiny, framing="nemo")
    assert eng._features.fast and eng._fast_pre is not None
    w = 18080
    x = torch.from_numpy(np.stack([formant_speech(w / 16000, seed=i)[:w] for i in range(3)]))
    for xl in (torch.full((3,), w), torch.tensor([w, w - 3000, 900])):
        assert torch.equal(eng._features(x, xl), model.preprocessor(input_signal=x, length=xl)[0])
    # all rows full-length: the masks are skipped; every frame before len // hop is still bitwise NeMo's
    xl = torch.full((3,), w)
    n = w // eng.framing.hop
    assert torch.equal(eng._features(x, xl, full=True)[..., :n], model.preprocessor(input_signal=x, length=xl)[0][..., :n])
    feats = model.preprocessor(input_signal=x, length=torch.full((3,), w))[0].transpose(1, 2)[:, :121]
    for lengths in (torch.full((3,), 121), torch.tensor([121, 64, 9])):
        a, al = model.encoder.pre_encode(x=feats, lengths=lengths)
        b, bl = eng._pre_encode(feats, lengths, bool((lengths == 121).all()))
        assert torch.equal(al, bl) and a.shape == b.shape
        for row, n in enumerate(al.tolist()):
            torch.testing.assert_close(b[row, :n], a[row, :n], rtol=1e-5, atol=1e-5)
            assert not torch.equal(b[row, :n], torch.zeros_like(b[row, :n]))
    # weights changed after construction (loading, dtype casts) are seen: the cached first kernel is rebuilt
    w0 = eng._fast_pre.first.weight
    full = torch.full((3,), 121)
    before, _ = eng._pre_encode(feats, full)
    saved = w0.clone()
    w0.copy_(w0.flip(-1))
    try:
        a, _ = model.encoder.pre_encode(x=feats, lengths=full)
        b, _ = eng._pre_encode(feats, full)
    finally:
        w0.copy_(saved)
    torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
    assert (b - before).abs().max() > 1e-3


@pytest.mark.parametrize("cut", [21_000, 37_000, 52_000])  # mid-chunk: pending audio is copied too
def test_a_fork_ends_as_the_stream_would_and_leaves_it_untouched(tiny, cut):
    """fork() copies a stream mid-utterance into a spare slot. Reference: the same audio on a
    second engine, never forked. The copy, ended at once, gives the final transcript and word
    times the reference gives when ended at that point; the stream itself, fed on and ended
    later, gives what the reference gives for all of it (the copy's steps, batched beside it,
    changed nothing)."""
    pcm = formant_speech(4.0, seed=11)
    forked, ref_now, ref_all = _engine(tiny), _engine(tiny), _engine(tiny)
    for engine in (forked, ref_now, ref_all):
        engine.open("s")
        engine.feed("s", pcm[:cut])
        while engine.pending():
            engine.step()
    forked.fork("s", "copy")
    assert len(forked.active_streams) == 2
    # every per-slot row the engine keeps (what SlotState.reset resets) is the stream's own
    src, dst = forked._streams["s"].slot, forked._streams["copy"].slot
    st = forked.state
    rows = [(c, 1) for c in st.caches] + [(st.cache_len, 0), (st.mel_cache, 0), (st.hc, 1), (st.g, 0)]
    for tensor, dim in rows:
        assert torch.equal(tensor.select(dim, dst), tensor.select(dim, src))
    forked.end("copy")
    forked.feed("s", pcm[cut:])  # the stream goes on while its copy's last chunk is decoded beside it
    copy_final = None
    while forked.pending():
        copy_final = next((e for e in forked.step() if e.kind == "final"), copy_final)
    forked.close("copy")
    want_now = _final(ref_now, "s")
    assert copy_final.stream_id == "copy" and copy_final.text == want_now.text and want_now.text
    assert copy_final.tokens == want_now.tokens and copy_final.words == want_now.words
    ref_all.feed("s", pcm[cut:])
    assert _final(forked, "s").tokens == _final(ref_all, "s").tokens
    assert forked.active_streams == ["s"] and len(forked._free) == forked.num_slots - 1


def test_a_fork_needs_a_free_slot(tiny):
    engine = _engine(tiny, num_slots=1)
    engine.open("s")
    with pytest.raises(NoFreeSlot):
        engine.fork("s", "copy")
    assert engine.active_streams == ["s"]
