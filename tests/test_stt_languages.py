"""The multilingual, language-prompted recogniser (nemotron-3.5-asr-streaming's architecture, tiny,
random weights): streams in different languages share one batched step, and each one's tokens
equal NeMo's own offline pass of the same model prompted with that stream's language."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from pipeline.audio import formant_speech
from pipeline.stt.config import STTConfig
from pipeline.stt.engine import STTEngine
from pipeline.stt.model import build_tiny_model
from pipeline.stt.reference import offline_tokens

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def multilingual(tmp_path_factory):
    cfg = STTConfig.tiny(multilingual=True, num_slots=4, cache_dir=str(tmp_path_factory.mktemp("stt_ml")))
    return cfg, build_tiny_model(cfg)


def _finals(engine, audios: dict[str, np.ndarray], piece: int = 2400) -> dict[str, object]:
    """Feed every open stream its audio in ``piece``-sample steps, all in the same batched steps, then end them."""
    finals = {}
    for pos in range(0, max(len(a) for a in audios.values()), piece):
        for sid, pcm in audios.items():
            engine.feed(sid, pcm[pos : pos + piece])
        engine.step()
    for sid in audios:
        engine.end(sid)
    while engine.pending():
        finals.update({e.stream_id: e for e in engine.step() if e.kind == "final"})
    return finals


def test_streams_in_four_languages_share_a_step_and_each_equals_nemo_in_its_language(multilingual):
    cfg, model = multilingual
    engine = STTEngine(model, cfg)
    pcm = formant_speech(2.6, seed=11)
    langs = {"s_fr": "fr", "s_de": "de", "s_en": "en-US", "s_auto": None}
    for sid, lang in langs.items():
        engine.open(sid, lang)
    finals = _finals(engine, dict.fromkeys(langs, pcm))
    refs = {sid: offline_tokens(model, pcm, lang) for sid, lang in langs.items()}
    assert len({tuple(r) for r in refs.values()}) == 4  # the prompt changes what is heard: a real test
    for sid in langs:
        assert finals[sid].tokens == refs[sid], sid


def test_a_fork_keeps_its_streams_language(multilingual):
    cfg, model = multilingual
    engine = STTEngine(model, cfg)
    pcm = formant_speech(2.0, seed=12)
    engine.open("a", "fr")
    engine.open("b", "de")  # a neighbour in another language, stepped alongside
    half = 16000
    for sid in ("a", "b"):
        engine.feed(sid, pcm[:half])
    while engine.pending():
        engine.step()
    engine.fork("a", "a_copy")
    engine.end("a_copy")
    finals = {}
    while engine.pending():
        finals.update({e.stream_id: e for e in engine.step() if e.kind == "final"})
    assert finals["a_copy"].tokens == offline_tokens(model, pcm[:half], "fr")
    assert finals["a_copy"].tokens != offline_tokens(model, pcm[:half], "de")


def test_a_slot_a_french_stream_left_hears_the_next_stream_in_its_own_language(multilingual):
    cfg, model = multilingual
    engine = STTEngine(model, dataclasses.replace(cfg, num_slots=1))
    pcm = formant_speech(1.6, seed=14)
    engine.open("fr", "fr")
    _finals(engine, {"fr": pcm})
    engine.close("fr")
    engine.open("next")  # the same (only) slot, no language asked: the model's default ("auto")
    assert _finals(engine, {"next": pcm})["next"].tokens == offline_tokens(model, pcm, None) != offline_tokens(model, pcm, "fr")


def test_a_language_the_model_does_not_speak_is_refused_by_name(multilingual):
    cfg, model = multilingual
    engine = STTEngine(model, cfg)
    with pytest.raises(ValueError, match="does not speak 'ja'.*'fr'"):
        engine.open("x", "ja")
    assert engine.active_streams == [] and len(engine._free) == cfg.num_slots  # nothing taken
    engine.open("y", "fr-CA")  # a regional code falls back to its language
    assert engine.languages.resolve("fr-CA") == "fr"


def test_language_tags_are_never_text(multilingual):
    """The model's vocabulary has language tags ("<fr-FR>"); one emitted is kept in the tokens (they
    equal NeMo's) and left out of the text and the words."""
    cfg, model = multilingual
    engine = STTEngine(model, cfg)
    tag = engine.tokenizer.token_to_id("<fr-FR>")
    assert tag in engine.languages.tags
    joint_out = [m for m in model.joint.joint_net.modules() if isinstance(m, torch.nn.Linear)][-1]
    pcm = formant_speech(2.0, seed=13)
    with torch.no_grad():
        joint_out.bias[tag] += 4.0  # the random joint now emits the tag often
    try:
        engine.open("t", "fr")
        final = _finals(engine, {"t": pcm})["t"]
        ref = offline_tokens(model, pcm, "fr")
    finally:
        with torch.no_grad():
            joint_out.bias[tag] -= 4.0
    assert final.tokens == ref
    assert tag in final.tokens
    assert final.text and "<" not in final.text
    assert all("<" not in w["word"] for w in final.words)


def test_the_english_model_speaks_english_and_takes_no_prompt(tmp_path):
    cfg = STTConfig.tiny(num_slots=2, cache_dir=str(tmp_path))
    engine = STTEngine(build_tiny_model(cfg), cfg)
    assert engine.languages.codes == ("en",) and not engine.languages.prompted
    engine.open("a", "en-GB")
    with pytest.raises(ValueError, match="does not speak 'fr'"):
        engine.open("b", "fr")
