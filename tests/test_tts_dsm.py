"""Kyutai's DSM TTS as a second voice family (pipeline/tts/dsm), tiny, random weights, greedy: many
streams in one batched step, each with its own voice and words that arrive one at a time, give the
codes moshi's own ``TTSModel.generate`` gives for that text and voice alone."""
from __future__ import annotations

from pathlib import Path

import numpy as np

import pytest
import torch
from safetensors.torch import save_file

from pipeline.tts.dsm.model import load_dsm, tiny_voice
from pipeline.tts.dsm.slots import DSMSlots

torch.set_num_threads(1)
A = "Hello there, how are you?"
B = "Bonjour mon ami, ça va?"


@pytest.fixture(scope="module")
def dsm(tmp_path_factory):
    cache = tmp_path_factory.mktemp("dsm")
    tts = load_dsm("tiny", temp=0.0, cache_dir=str(cache))
    voices = {}
    for name in ("default", "marie"):
        voices[name] = cache / f"{name}.safetensors"
        save_file({"speaker_wavs": tiny_voice(name)}, str(voices[name]))
    return tts, voices


def _alone(tts, voices, text: str, voice: str) -> torch.Tensor:
    """moshi's own generation of ``text`` in ``voice``: its frames' 32 codes each."""
    attributes = tts.make_condition_attributes([Path(voices[voice])], 2.0)
    result = tts.generate([tts.prepare_script([text], padding_between=1)], [attributes])
    return torch.stack([f[0, 1:, 0] for f in result.frames])


def test_streams_joining_late_with_their_own_voice_and_words_one_at_a_time_equal_moshi_alone(dsm):
    tts, voices = dsm
    slots = DSMSlots(tts, 3, voices, "default")
    try:
        for row in (0, 2):
            slots.open(row)
            slots.push(row, A, final=True)  # all the text at once
        for _ in range(6):  # the others are well under way when row 1 joins
            slots.step()
        slots.open(1, "marie")
        words = B.split(" ")
        for i, word in enumerate(words):  # a word every 4 steps: slower than the row would take them
            slots.push(1, word + (" " if i < len(words) - 1 else ""), final=i == len(words) - 1)
            for _ in range(4):
                slots.step()
        while not all(slots.done(r) for r in range(3)):
            slots.step()
        rows = [torch.stack(slots.rows[r].frames) for r in range(3)]
    finally:
        slots.close_all()
    ref_b = _alone(tts, voices, B, "marie")
    ref_a = _alone(tts, voices, A, "default")
    assert torch.equal(rows[1], ref_b)
    assert torch.equal(rows[0], ref_a) and torch.equal(rows[2], ref_a)
    assert not torch.equal(ref_b, _alone(tts, voices, B, "default"))  # the voice changes the codes: a real test
    assert (ref_b >= 0).all(1).any()  # and some frames carry audio on every codebook


def test_a_row_takes_words_only_with_its_lookahead_and_refuses_text_after_its_end(dsm):
    tts, voices = dsm
    slots = DSMSlots(tts, 2, voices, "default")
    try:
        slots.open(0)
        slots.push(0, "one two")  # "two" is not whole yet: one word, not more than the lookahead of 2
        ran = 0
        while slots.step():  # only the padding every stream starts with (the machine's initial_padding)
            ran += 1
        assert ran == tts.machine.initial_padding and not slots.ready(0)
        slots.push(0, " three four ")
        assert slots.ready(0)
        slots.push(0, "", final=True)
        with pytest.raises(RuntimeError, match="already complete"):
            slots.push(0, "five")
        with pytest.raises(KeyError, match="unknown DSM voice 'nobody'"):
            slots.open(1, "nobody")
    finally:
        slots.close_all()


def test_the_engine_queues_streams_past_its_rows_and_a_cancelled_one_frees_its_row():
    from pipeline.engines import Segment
    from pipeline.tts.config import TTSConfig
    from pipeline.tts.dsm.engine import DSMEngine, voice_files

    cfg = TTSConfig.tiny(family="dsm", num_slots=1, temperature=0.0,
                         voices={"marie": {"voice": "cml-tts/fr/2154_2576_000020.wav"}})
    engine = DSMEngine(cfg)
    first = engine.stream("Bonjour à tous.", speaker="marie")
    second = engine.stream("Hello again.")
    engine.step()
    assert (first.row, second.row, engine.active_requests) == (0, None, 2)  # one row: the second waits
    engine.cancel(first)
    while not second.finished:
        engine.step()
    chunks = []
    while (item := second.take()) is not None:
        chunks.append(item)
    assert chunks and sum(len(pcm) for pcm, _ in chunks) > 0 and engine.active_requests == 0
    # the row it took from a cancelled stream in another voice: nothing of that one left in it
    engine.slots.close_all()  # (moshi's own generation below streams the same model)
    ref = _alone(engine.tts, voice_files(cfg, engine.tts), "Hello again.", "default")
    assert np.array_equal(np.concatenate([codes for _, codes in chunks]), ref[(ref >= 0).all(1)].numpy())
    with pytest.raises(ValueError, match="no voice clip"):
        engine.stream("Hi.", reference=Segment(0, "clip", np.zeros((3, 32), np.int64)))
    with pytest.raises(KeyError, match="unknown voice 'nobody'"):
        engine.stream("Hi.", speaker="nobody")


CLAUSES = ["Hello there, my friend.", "How are you today?", "I am fine, thank you."]


def test_a_reply_said_clause_by_clause_is_one_stream_with_each_clause_marked_where_moshi_speaks_it():
    """One utterance whose clauses come as an LLM writes them (each after the row has run dry of
    words) makes the codes moshi makes of the whole text at once, and the chunk each clause's audio
    begins with carries its index: at the frame moshi's own run consumed its first word, plus the
    model's audio delay (the first clause: the first chunk)."""
    from pipeline.tts.config import TTSConfig
    from pipeline.tts.dsm.engine import DSMEngine, voice_files

    cfg = TTSConfig.tiny(family="dsm", num_slots=2, temperature=0.0)
    engine = DSMEngine(cfg)
    other = engine.stream("Someone else speaks beside it.")  # another row under way all along
    s = engine.open()
    for i, clause in enumerate(CLAUSES):
        engine.say(s, clause)
        while engine.slots.ready(s.row) if s.row is not None else True:
            engine.step()  # until the row waits for words (the text is ahead of the audio)
    assert not s.finished and s.generated > 0
    engine.say(s, "", final=True)
    with pytest.raises(ValueError, match="already said"):
        engine.say(s, "More.")
    while not (s.finished and other.finished):
        engine.step()
    chunks = []
    while (item := s.take_marked()) is not None:
        chunks.append(item)
    engine.slots.close_all()

    attributes = engine.tts.make_condition_attributes([Path(voice_files(cfg, engine.tts)["default"])], cfg.dsm_cfg_coef)
    text = " ".join(CLAUSES)
    result = engine.tts.generate([engine.tts.prepare_script([text], padding_between=cfg.dsm_padding_between)],
                                 [attributes])
    ref = torch.stack([f[0, 1:, 0] for f in result.frames])
    audible = (ref >= 0).all(1)
    codes = np.concatenate([c for _, _, c in chunks])
    assert np.array_equal(codes, ref[audible].numpy())

    words = [w for w, _ in result.all_transcripts[0]]
    assert words == text.split()  # (a word per entry: the clauses' first words are found by count)
    starts, at = [], 0
    for clause in CLAUSES:
        step = result.all_transcripts[0][at][1]
        starts.append(int(audible[: step + engine.tts.delay_steps].sum()))  # audible frames before it
        at += len(clause.split())
    offsets = np.cumsum([0] + [len(c) for _, _, c in chunks])[:-1]
    marked = {mark: int(offset) for (mark, _, _), offset in zip(chunks, offsets) if mark is not None}
    # the first clause marks the first chunk (with the model's lead-in frames before its first word)
    assert marked == {0: 0, 1: starts[1], 2: starts[2]} and starts[0] < starts[1] < starts[2]
