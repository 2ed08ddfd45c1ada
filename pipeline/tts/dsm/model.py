"""Kyutai's delayed-streams TTS (DSM, ``moshi.models.tts.TTSModel``): the real checkpoint through
moshi's own loading, or the same architecture at a tiny size with random weights.

The model: a text-and-audio language model (``LMModel``) over Mimi's 32 codebooks, the text
stream leading the audio by ``delay_steps`` frames (1.28 s), a second text stream that shows the
word ``second_stream_ahead`` words ahead, and the voice as cross-attention over a speaker
embedding (``speaker_wavs``, [1, 512, T] per voice, from ``kyutai/tts-voices``). It takes words
as they come: a word is consumed when the model asks for one, so speech can start after the
first few words of a reply, not its first clause. ``kyutai/tts-1.6b-en_fr`` speaks English and
French.
"""
from __future__ import annotations

import copy
import io
import os
from pathlib import Path

import torch

DSM_REPO = "kyutai/tts-1.6b-en_fr"
DSM_VOICE_REPO = "kyutai/tts-voices"
DSM_LANGUAGES = ("en", "fr")
SPEAKER_DIM = 512  # a voice embedding's channels (speaker_wavs)

_TINY_TEXT = [
    "Hello, how are you today? I am fine, thank you very much.",
    "The quick brown fox jumps over the lazy dog while the band plays on.",
    "Bonjour, comment allez-vous aujourd'hui? Je vais bien, merci beaucoup.",
    "Pouvez-vous réserver une table pour deux personnes ce soir?",
    "Streaming speech turns the words of a reply into audio as they arrive.",
]


def tiny_lm_config(text_card: int) -> dict:
    """The 1.6B DSM's LMModel config (its streams, delays, depformer schedule, conditioners and
    cross-attention fuser, as published) with small widths and depths."""
    return {
        "card": 2048, "n_q": 32, "dep_q": 32, "delays": [0, 0] + [2] * 31,
        "dim": 64, "text_card": text_card, "existing_text_padding_id": 3,
        "num_heads": 4, "num_layers": 2, "hidden_scale": 4.125, "causal": True, "layer_scale": None,
        "context": 500, "max_period": 10000, "gating": "silu", "norm": "rms_norm_f32", "positional_embedding": "rope",
        "depformer_dim": 32, "depformer_num_heads": 2, "depformer_num_layers": 1, "depformer_dim_feedforward": 64,
        "depformer_multi_linear": True, "depformer_pos_emb": "none", "depformer_weights_per_step": True,
        "depformer_weights_per_step_schedule": list(range(8)) + [8] * 8 + [9] * 8 + [10] * 8,
        "depformer_low_rank_embeddings": 16, "demux_second_stream": True, "text_card_out": None,
        "cross_attention": True,
        "conditioners": {
            "speaker_wavs": {"type": "tensor", "tensor": {"dim": SPEAKER_DIM}},
            "cfg": {"type": "lut", "lut": {"n_bins": 7, "dim": 16, "tokenizer": "noop",
                                           "possible_values": ["1.0", "1.5", "2.0", "2.5", "3.0", "3.5", "4.0"]}},
            "control": {"type": "lut", "lut": {"dim": 64, "n_bins": 1, "tokenizer": "noop", "possible_values": ["ok"]}},
        },
        "fuser": {"cross_attention_pos_emb": True, "cross_attention_pos_emb_scale": 1, "sum": ["control", "cfg"],
                  "prepend": [], "cross": ["speaker_wavs"]},
    }


def tiny_tokenizer(cache_dir: str | None = None, vocab_size: int = 128) -> str:
    """A small SentencePiece model of English and French (ids 0-3 reserved, as Kyutai's tokenizer
    keeps them for its special text tokens), trained once here; returns its path."""
    import sentencepiece as spm

    cache_dir = cache_dir or os.path.join(os.path.expanduser("~"), ".cache", "gapless", "dsm-tiny")
    path = os.path.join(cache_dir, f"tokenizer_v{vocab_size}.model")
    if os.path.exists(path):
        return path
    os.makedirs(cache_dir, exist_ok=True)
    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(_TINY_TEXT * 20), model_writer=buf, vocab_size=vocab_size,
                                   model_type="unigram", character_coverage=1.0, unk_id=0, bos_id=1, eos_id=2,
                                   pad_id=3, minloglevel=2, hard_vocab_limit=False)
    tmp = f"{path}.{os.getpid()}.tmp"
    Path(tmp).write_bytes(buf.getvalue())
    os.replace(tmp, path)  # atomic: a concurrent builder either wins or finds it done
    return path


def load_dsm(profile: str, device: str = "cpu", dtype: torch.dtype = torch.float32, temp: float = 0.6,
             cache_dir: str | None = None, seed: int = 0):
    """A ``TTSModel``: ``profile`` "real" loads ``kyutai/tts-1.6b-en_fr`` through moshi's own
    ``CheckpointInfo`` (it must be in the local Hugging Face cache); "tiny" builds the same
    architecture with random weights (seeded) and a tiny Mimi through the same constructor."""
    from moshi.models import loaders
    from moshi.models.tts import TTSModel

    if profile == "real":
        from pipeline.runtime.weights import require_pretrained

        require_pretrained(DSM_REPO, what="TTS (DSM)")
        info = loaders.CheckpointInfo.from_hf_repo(DSM_REPO)
    elif profile == "tiny":
        from pipeline.tts.mimi import tiny_mimi_config

        text_card = 128
        lm_config = tiny_lm_config(text_card)
        raw = dict(lm_config, tts_config={"audio_delay": 1.28, "second_stream_ahead": 2},
                   model_id={"sig": "tiny0000", "epoch": 0}, model_type="tts")
        info = loaders.CheckpointInfo(moshi_weights=None, mimi_weights=None, tokenizer=tiny_tokenizer(cache_dir, text_card),
                                      lm_config=copy.deepcopy(lm_config), raw_config=raw, mimi_config=tiny_mimi_config(),
                                      model_type="tts", tts_config=raw["tts_config"], model_id=raw["model_id"])
        torch.manual_seed(seed)
    else:
        raise ValueError(f"the DSM TTS profile must be 'tiny' or 'real', got {profile!r}")
    return TTSModel.from_checkpoint_info(info, n_q=32, temp=temp, device=device, dtype=dtype)


def tiny_voice(name: str, frames: int = 125) -> torch.Tensor:
    """A random voice embedding ([1, 512, frames], as a kyutai/tts-voices file holds), the same for
    the same name."""
    g = torch.Generator().manual_seed(sum(name.encode()) * 7919 + len(name))
    return torch.randn(1, SPEAKER_DIM, frames, generator=g)
