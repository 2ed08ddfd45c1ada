"""Streaming TTS engine (tiny profile, CPU): CSM parity with transformers, Mimi streaming, streams."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from pipeline.audio_constants import CODEC_FRAME_SAMPLES
from pipeline.tts.config import TTSConfig
from pipeline.tts.csm import CSM, arch_from_hf_config, load_csm, map_hf_state_dict, tiny_arch
from pipeline.tts.engine import Segment, TTSEngine
from pipeline.tts.mimi import SlotDecoder, load_mimi
from pipeline.tts.sampling import Race, race_noise

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def engine():
    return TTSEngine(TTSConfig.tiny(max_frames=40, max_seq_len=256))


# -- 1. parity with transformers' CsmForConditionalGeneration ------------------------------------
def _hf_config(arch):
    from transformers import CsmConfig

    b, d = arch.backbone, arch.decoder
    return CsmConfig(
        num_codebooks=arch.num_codebooks, vocab_size=arch.audio_vocab, text_vocab_size=arch.text_vocab,
        hidden_size=b.dim, intermediate_size=b.ffn_dim, num_hidden_layers=b.n_layers,
        num_attention_heads=b.n_heads, num_key_value_heads=b.n_kv_heads, rope_parameters=dict(b.rope),
        max_position_embeddings=256, pad_token_id=None, bos_token_id=None, audio_token_id=None,
        audio_eos_token_id=None, codebook_pad_token_id=None,
        depth_decoder_config=dict(
            num_codebooks=arch.num_codebooks, backbone_hidden_size=b.dim, vocab_size=arch.audio_vocab,
            hidden_size=d.dim, intermediate_size=d.ffn_dim, num_hidden_layers=d.n_layers,
            num_attention_heads=d.n_heads, num_key_value_heads=d.n_kv_heads, rope_parameters=dict(d.rope),
            max_position_embeddings=arch.num_codebooks + 1,
        ),
        codec_config=dict(model_type="mimi", num_hidden_layers=1),
    )


@pytest.fixture(scope="module")
def hf_model(engine):
    from transformers import CsmForConditionalGeneration

    torch.manual_seed(0)
    hf = CsmForConditionalGeneration(_hf_config(tiny_arch(len(engine.tokenizer)))).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():  # norms start at 1: perturb them so the mapping is tested
            if name.endswith("norm.weight") or "layernorm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    return hf


@torch.inference_mode()
def test_parity_with_transformers(engine, hf_model):
    hf = hf_model
    arch = tiny_arch(len(engine.tokenizer))
    assert arch_from_hf_config(hf.config) == arch
    ours = CSM(arch).eval()
    ours.load_state_dict(map_hf_state_dict(hf.state_dict(), arch), strict=True)
    ours.setup_caches(128)

    rng = np.random.default_rng(0)
    ctx = Segment(speaker=1, text="Hello there.", codes=rng.integers(0, 2048, (5, 32)))
    tokens, mask = engine.prompts.build(0, "How are you today?", [ctx], 100)
    k = arch.num_codebooks
    rows = []  # transformers' inputs_embeds: text rows via embed_text_tokens, audio rows via the codebook sum
    for t, m in zip(tokens, mask):
        if m[k]:
            rows.append(hf.embed_text_tokens(torch.tensor([t[k]])))
        else:
            rows.append(hf.backbone_model.embed_tokens(torch.tensor(t[:k])[None, None])[0])
    out = hf(inputs_embeds=torch.cat(rows)[None], use_cache=True)
    h = ours.prefill(torch.from_numpy(tokens)[None], torch.from_numpy(mask)[None])
    torch.testing.assert_close(ours.c0_logits(h), out.logits[:, -1], atol=1e-4, rtol=1e-4)

    cache, pos = out.cache, len(tokens)
    for _ in range(2):  # generated frames fed back one position at a time
        frame = torch.from_numpy(rng.integers(0, 2048, (1, k)))
        out = hf(input_ids=frame[:, None], cache=cache, use_cache=True)
        cache = out.cache
        h = ours.backbone_step(frame, torch.tensor([pos]))
        pos += 1
        torch.testing.assert_close(ours.c0_logits(h), out.logits[:, -1], atol=1e-4, rtol=1e-4)

    # depth decoder, teacher-forced over all 31 codebooks from the same backbone hidden state
    codes = torch.from_numpy(rng.integers(0, 2048, (1, k)))
    hf_depth = hf.depth_decoder(input_ids=torch.cat([torch.zeros(1, 1, dtype=torch.long), codes[:, :-1]], 1),
                                backbone_last_hidden_state=h).logits
    torch.testing.assert_close(ours.depth_logits(h, codes[:, :-1]), hf_depth, atol=1e-4, rtol=1e-4)

    # the per-step path (static depth cache, one position at a time), greedy, agrees with transformers
    ours.n_valid = arch.audio_vocab
    greedy = ours.sample_frame(h, temperature=0.0, top_k=0)
    assert greedy[0, 0] == hf.lm_head(h).argmax(-1)[0]
    hf_depth = hf.depth_decoder(input_ids=torch.cat([torch.zeros(1, 1, dtype=torch.long), greedy[:, :-1]], 1),
                                backbone_last_hidden_state=h).logits
    assert torch.equal(hf_depth.argmax(-1), greedy[:, 1:])


def test_load_csm_reads_a_transformers_checkpoint(hf_model, tmp_path):
    from safetensors.torch import save_file

    hf_model.config.save_pretrained(tmp_path)
    sd = {k: v.contiguous() for k, v in hf_model.state_dict().items()
          if not k.startswith("codec_model.") and k != "depth_decoder.model.embed_tokens.weight"}  # tied copy
    save_file(sd, str(tmp_path / "model.safetensors"))
    ours = load_csm(str(tmp_path))
    ref = map_hf_state_dict(hf_model.state_dict(), ours.arch)
    assert ours.state_dict().keys() == ref.keys()
    assert all(torch.equal(ours.state_dict()[k], ref[k]) for k in ref)


# -- 2. Mimi streaming decode, per slot ----------------------------------------------------------
@torch.inference_mode()
def test_slot_decode_matches_full_decode_and_masked_rows_keep_their_state():
    """Two streams in one batched decode: each row's audio equals a whole-utterance decode of its
    codes, although row 1 pauses (junk input, exec mask off) at some steps and row 0 at others."""
    mimi = load_mimi("tiny", seed=0)
    rng = np.random.default_rng(1)
    codes = torch.from_numpy(rng.integers(0, 2048, (2, 32, 10)))
    full = [mimi.decode(codes[r : r + 1])[0, 0] for r in range(2)]
    pauses = [{4, 5}, {1, 2, 3, 9}]  # steps at which a row gets no frame
    dec = SlotDecoder(mimi, rows=2)
    try:
        def run() -> list[torch.Tensor]:
            done, out = [0, 0], [[], []]
            for t in range(14):
                active = [t not in pauses[r] and done[r] < 10 for r in range(2)]
                frame = torch.from_numpy(rng.integers(0, 2048, (2, 32, 1)))  # junk where inactive
                for r in range(2):
                    if active[r]:
                        frame[r] = codes[r, :, done[r] : done[r] + 1]
                y = dec.decode(frame, torch.tensor(active))
                for r in range(2):
                    if active[r]:
                        out[r].append(y[r])
                        done[r] += 1
            assert done == [10, 10]
            return [torch.cat(o) for o in out]

        for r, audio in enumerate(run()):
            torch.testing.assert_close(audio, full[r], atol=1e-5, rtol=1e-4)
        dec.reset(torch.tensor([True, True]))  # fresh rows: the same streams decode the same again
        for r, audio in enumerate(run()):
            torch.testing.assert_close(audio, full[r], atol=1e-5, rtol=1e-4)
    finally:
        dec.close()


def test_race_noise_is_a_function_of_seed_and_counter_only():
    seeds, counters = torch.tensor([7, 8, 7, 123456789]), torch.tensor([0, 0, 5, 2**40])
    n = race_noise(seeds, counters, 32, 50)
    assert n.shape == (4, 32, 50) and (n > 0).all()
    torch.testing.assert_close(race_noise(seeds[2:3], counters[2:3], 32, 50)[0], n[2], rtol=0, atol=0)
    assert not torch.equal(n[0], n[1]) and not torch.equal(n[0], n[2])
    big = race_noise(torch.arange(64), torch.zeros(64, dtype=torch.long), 32, 50).flatten().double()
    assert abs(big.mean().item() - 1.0) < 0.02 and abs(big.var().item() - 1.0) < 0.05  # Exp(1)
    u = torch.exp(-big).sort().values  # uniform if Exp(1): Kolmogorov-Smirnov distance
    ks = (u - torch.arange(1, len(u) + 1, dtype=torch.float64) / len(u)).abs().max().item()
    assert ks < 1.36 / len(u) ** 0.5  # the 5 % critical value


def _race_in_probabilities(logits, temperature, top_k, noise):
    """The exponential race as written: softmax(z / t) over the top k, divided by the noise, argmax."""
    out = []
    for z, t, e in zip(logits.double(), temperature.double(), noise.double()):
        if t <= 0:
            out.append(int(z.argmax()))
            continue
        # the noise's columns follow the candidates in the order the sampler's top-k returns them
        cand = z.float().topk(top_k, sorted=False).indices if top_k else torch.arange(len(z))
        p = torch.softmax(z[cand] / t, dim=0)
        out.append(int(cand[(p / e[: len(cand)]).argmax()]))
    return out


@pytest.mark.parametrize("top_k", [50, 0])
def test_race_draws_what_the_race_in_probabilities_draws(top_k):
    """Race (log space, per-frame parts hoisted) against the race written in probabilities, in
    float64, on 512 rows of random logits at mixed temperatures (some greedy): the same tokens."""
    g = torch.Generator().manual_seed(0)
    rows, vocab, n_valid = 512, 2051, 2048
    logits = torch.randn(rows, vocab, generator=g) * 3
    temperature = torch.tensor([0.0, 0.5, 0.9, 1.3] * (rows // 4))
    width = top_k or n_valid
    noise = race_noise(torch.arange(rows), torch.zeros(rows, dtype=torch.long), 2, width)
    race = Race(temperature, top_k, n_valid, noise)
    got = race.draw(logits, 1)[:, 0].tolist()
    want = _race_in_probabilities(logits[:, :n_valid], temperature, top_k, noise[:, 1])
    assert got == want
    assert got[::4] == logits[::4, :n_valid].argmax(1).tolist()  # temperature 0: the argmax
    assert len(set(got[2::4])) > 100  # sampled rows really draw (not the argmax every time)


# -- 3. stream() ------------------------------------------------------------------------------
def test_stream_chunks_codes_and_active_requests(engine):
    cfg = engine.cfg
    text = "Hello, how are you today?"
    s = engine.stream(text)
    assert engine.active_requests == 1
    chunks = list(s)
    assert engine.active_requests == 0
    assert engine.sample_rate == 24000
    assert all(c.dtype == np.int16 and c.ndim == 1 and c.flags.c_contiguous for c in chunks)
    assert len(chunks[0]) == cfg.first_chunk_frames * CODEC_FRAME_SAMPLES
    assert all(len(c) == cfg.chunk_frames * CODEC_FRAME_SAMPLES for c in chunks[1:-1])
    assert s.frames == engine.max_frames_for(text) == sum(len(c) for c in chunks) // CODEC_FRAME_SAMPLES
    assert s.codes.shape == (s.frames, 32) and s.codes.dtype == np.int64
    assert s.codes.min() >= 0 and s.codes.max() < 2048
    with torch.inference_mode():  # .codes are exactly the frames that produced the audio
        ref = load_mimi("tiny", seed=cfg.seed).decode(torch.from_numpy(s.codes).T[None])[0, 0]  # the same weights
    ref16 = (ref.clamp(-1, 1) * 32767).round().numpy()
    assert np.abs(np.concatenate(chunks).astype(np.float64) - ref16).max() <= 4

    # generation is reproducible: the same text and seed give the same first chunk (codes and audio);
    # early close: the slot is released
    early = engine.stream(text, seed=s.seed)
    first = next(early)
    np.testing.assert_array_equal(first, chunks[0])
    np.testing.assert_array_equal(early.codes, s.codes[: cfg.first_chunk_frames])
    assert engine.active_requests == 1 and early.row is not None
    early.close()
    assert engine.active_requests == 0 and early.frames == cfg.first_chunk_frames and early.row is None
    assert list(early) == []
    assert len(first) == cfg.first_chunk_frames * CODEC_FRAME_SAMPLES

    # streams coexist: one left open does not stop another
    a = engine.stream(text)
    next(a)
    b = engine.stream("Goodbye.")
    assert engine.active_requests == 2
    assert sum(len(c) for c in b) == engine.max_frames_for("Goodbye.") * CODEC_FRAME_SAMPLES
    assert engine.active_requests == 1 and not a.closed
    a.close()
    assert engine.active_requests == 0


def test_stream_stops_at_all_zero_frame(engine, monkeypatch):
    frame = engine.fns["frame"]
    calls = {"n": 0}

    def step(*args):
        codes = frame(*args)
        calls["n"] += 1
        return torch.zeros_like(codes) if calls["n"] == 6 else codes

    monkeypatch.setitem(engine.fns, "frame", step)
    s = engine.stream("one two three four five six seven eight")
    chunks = list(s)
    assert s.frames == 5 and sum(len(c) for c in chunks) == 5 * CODEC_FRAME_SAMPLES
    assert engine.active_requests == 0


# -- 4. prompt buckets ---------------------------------------------------------------------------
@torch.inference_mode()
def test_bucketed_prefill_equals_unpadded(engine):
    """Padding a prompt at the end to its bucket changes nothing: same hidden state, same frames.
    Row 0 holds the unpadded prompt (the plain prefill), row 1 the bucketed one; both then step
    together, each at its own cache row."""
    rng = np.random.default_rng(3)
    ctx = [Segment(1, "Hi.", rng.integers(0, 2048, (7, 32)))]
    tokens, mask = engine.build_prompt("How are you?", ctx)
    assert engine.bucket_for(len(tokens)) > len(tokens)  # really padded
    csm = engine.csm
    h_ref = csm.prefill(torch.from_numpy(tokens)[None], torch.from_numpy(mask)[None])  # cache row 0
    h_pad = engine.prefill(tokens, mask, row=1)
    torch.testing.assert_close(h_pad, h_ref, atol=1e-5, rtol=1e-5)
    h0, first = torch.cat([h_ref, h_pad]), torch.tensor([True, True])
    pos = torch.full((2,), len(tokens), dtype=torch.long)
    codes = torch.zeros(2, 32, dtype=torch.long)
    greedy = torch.zeros(2)
    for i in range(3):
        codes = csm.frame_fn(h0, first, codes, pos + max(i - 1, 0), None, greedy, 0)
        first = torch.tensor([False, False])
        assert torch.equal(codes[0], codes[1]), i
    assert engine.prefill_buckets[-1] == engine.cfg.max_seq_len


# -- 5. context segments -------------------------------------------------------------------------
def test_generated_codes_pass_through_as_context(engine):
    s = engine.stream("Nice to meet you.")
    for _ in s:
        pass
    bot = Segment(speaker=0, text="Nice to meet you.", codes=s.codes)
    user_pcm = (np.sin(np.arange(24000) / 24000 * 2 * np.pi * 220) * 8000).astype(np.int16)
    user_codes = engine.encoder.encode(user_pcm)
    assert user_codes.shape == (13, 32) and user_codes.dtype == np.int64
    user = Segment(speaker=1, text="And you too.", codes=user_codes)

    nxt = engine.stream("What can I do for you?", context=[bot, user])
    k = 32
    audio_rows = nxt.prompt_mask[:, :k].all(axis=1)
    start = int(np.flatnonzero(audio_rows)[0])
    got = nxt.prompt_tokens[start : start + len(bot.codes), :k]
    np.testing.assert_array_equal(got, bot.codes)  # passed through exactly, not re-encoded
    assert not nxt.prompt_tokens[start + len(bot.codes), :k].any()  # followed by the end-of-audio frame
    assert nxt.prompt_mask[:, k].sum() + audio_rows.sum() == len(nxt.prompt_tokens)
    text_ids, _ = engine.prompts.text_rows(0, "What can I do for you?")
    np.testing.assert_array_equal(nxt.prompt_tokens[-len(text_ids) :], text_ids)
    assert len(next(nxt)) == engine.cfg.first_chunk_frames * CODEC_FRAME_SAMPLES
    nxt.close()
    assert engine.active_requests == 0

    # context that does not fit is dropped oldest-first, whole segments only: room for the text, the
    # newest segment (user) and part of the older one (bot) keeps the text and user, nothing of bot
    user_rows, _ = engine.prompts.segment_rows(user)
    text_rows, _ = engine.prompts.text_rows(0, "Hi.")
    bot_rows, _ = engine.prompts.segment_rows(bot)
    budget = len(user_rows) + len(text_rows) + len(bot_rows) // 2
    tokens, _ = engine.prompts.build(0, "Hi.", [bot, user], max_rows=budget)
    np.testing.assert_array_equal(tokens, np.concatenate([user_rows, text_rows]))


# -- 6. checkpoint errors ------------------------------------------------------------------------
def test_checkpoint_errors_say_what_failed(monkeypatch, tmp_path):
    """Not in the cache, gated, and on disk but unreadable are three different errors, each naming
    the `hf download` command (huggingface-hub 2.x has no huggingface-cli)."""
    import huggingface_hub
    from huggingface_hub.errors import GatedRepoError
    from transformers import CsmConfig

    from pipeline.runtime.weights import CheckpointError, MissingCheckpointError

    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv("GAPLESS_ALLOW_DOWNLOAD", raising=False)
    with pytest.raises(MissingCheckpointError, match="not found locally.*`hf download gapless-test/no-such-csm`"):
        load_csm("gapless-test/no-such-csm")

    gated = GatedRepoError.__new__(GatedRepoError)  # as the hub client raises it for a gated repo
    Exception.__init__(gated, "Access to model gapless-test/gated is restricted.")

    def refuse(*args, **kwargs):
        raise gated

    with monkeypatch.context() as m:
        m.setattr(huggingface_hub, "snapshot_download", refuse)
        with pytest.raises(CheckpointError, match="is gated.*`hf download gapless-test/gated`") as info:
            load_csm("gapless-test/gated")
    assert not isinstance(info.value, MissingCheckpointError) and info.value.__cause__ is gated

    corrupt = tmp_path / "csm"  # a download cut short: config there, weights truncated
    CsmConfig().save_pretrained(corrupt)
    (corrupt / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{\"a\":")
    with pytest.raises(CheckpointError, match="is on this machine .* but could not be loaded") as info:
        load_csm(str(corrupt))
    assert not isinstance(info.value, MissingCheckpointError)
