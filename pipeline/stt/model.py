"""Building the recogniser: a random-weight cache-aware FastConformer RNNT (tiny, or at a real
model's shape), or a real .nemo checkpoint."""
from __future__ import annotations

import logging
import os

import torch

from pipeline.audio_constants import USER_RATE
from pipeline.stt.calibration import (
    calibrate_blank_bias,
    calibrate_blank_bias_cached,
    condition_random_joint,
    set_blank_bias,
)
from pipeline.stt.config import LOOKAHEADS, STTConfig
from pipeline.stt.framing import context_size
from pipeline.stt.languages import TINY_PROMPTS
from pipeline.stt.tiny_tokenizer import tiny_tokenizer_dir


def _silence_nemo() -> None:
    from nemo.utils import logging as nemo_logging

    nemo_logging.setLevel(logging.ERROR)


def tiny_model_config(tokenizer_dir: str, d_model: int = 64, n_layers: int = 2, max_symbols: int = 2):
    # Over 40 lines as one function: a config literal.
    from omegaconf import OmegaConf

    return OmegaConf.create(
        {
            "sample_rate": USER_RATE,
            "model_defaults": {"enc_hidden": d_model, "pred_hidden": d_model, "joint_hidden": d_model},
            "tokenizer": {"dir": tokenizer_dir, "type": "bpe"},
            "preprocessor": {
                "_target_": "nemo.collections.asr.modules.AudioToMelSpectrogramPreprocessor",
                "sample_rate": USER_RATE,
                "normalize": "NA",
                "window_size": 0.025,
                "window_stride": 0.01,
                "window": "hann",
                "features": 80,
                "n_fft": 512,
                "log": True,
                "frame_splicing": 1,
                "dither": 0.0,
                "pad_to": 0,
                "pad_value": 0.0,
            },
            "encoder": {
                "_target_": "nemo.collections.asr.modules.ConformerEncoder",
                "feat_in": 80,
                "feat_out": -1,
                "n_layers": n_layers,
                "d_model": d_model,
                "subsampling": "dw_striding",
                "subsampling_factor": 8,
                "subsampling_conv_channels": d_model,
                "causal_downsampling": True,
                "ff_expansion_factor": 2,
                "self_attention_model": "rel_pos",
                "n_heads": 4,
                "att_context_size": [list(a) for a in LOOKAHEADS],
                "att_context_style": "chunked_limited",
                "xscaling": True,
                "untie_biases": True,
                "pos_emb_max_len": 5000,
                "conv_kernel_size": 9,
                "conv_norm_type": "layer_norm",
                "conv_context_size": "causal",
                "dropout": 0.0,
                "dropout_pre_encoder": 0.0,
                "dropout_emb": 0.0,
                "dropout_att": 0.0,
            },
            "decoder": {
                "_target_": "nemo.collections.asr.modules.RNNTDecoder",
                "normalization_mode": None,
                "random_state_sampling": False,
                "blank_as_pad": True,
                "prednet": {"pred_hidden": d_model, "pred_rnn_layers": 2, "t_max": None, "dropout": 0.0},
            },
            "joint": {
                "_target_": "nemo.collections.asr.modules.RNNTJoint",
                "log_softmax": None,
                "preserve_memory": False,
                "fuse_loss_wer": False,
                "jointnet": {"joint_hidden": d_model, "activation": "relu", "dropout": 0.0},
            },
            "decoding": {"strategy": "greedy_batch", "greedy": {"max_symbols": max_symbols}},
        }
    )


MULTILINGUAL_LOOKAHEADS = ([56, 3], [56, 0], [56, 6], [56, 13])  # its chunks: 320, 80, 560, 1120 ms


def multilingual_config(cfg):
    """``cfg`` made the multilingual nemotron's architecture: a language prompt (a one-hot of
    ``num_prompts``) concatenated to the encoder output and projected back through an MLP
    (``prompt_kernel``: NeMo's ``EncDecRNNTBPEModelWithPrompt``), a left context of 56 frames, and
    no x-scaling or biases in the encoder, as its published config."""
    cfg.model_defaults.num_prompts = 128
    cfg.model_defaults.prompt_dictionary = dict(TINY_PROMPTS)
    cfg.model_defaults.initialize_prompt_feature = True
    cfg.encoder.att_context_size = [list(a) for a in MULTILINGUAL_LOOKAHEADS]
    cfg.encoder.xscaling = False
    cfg.encoder.use_bias = False
    return cfg


def _model_class(cfg: STTConfig):
    from nemo.collections.asr.models import EncDecRNNTBPEModel
    from nemo.collections.asr.models.rnnt_bpe_models_prompt import EncDecRNNTBPEModelWithPrompt

    return EncDecRNNTBPEModelWithPrompt if cfg.multilingual else EncDecRNNTBPEModel


def build_tiny_model(cfg: STTConfig):
    """A random-weight EncDecRNNTBPEModel with the cache-aware FastConformer shape, built offline
    (``cfg.multilingual``: the language-prompted one, with a multilingual tokenizer)."""
    _silence_nemo()
    tok_dir = tiny_tokenizer_dir(cfg.cache_dir, vocab_size=256 if cfg.multilingual else 128,
                                 multilingual=cfg.multilingual)
    model_cfg = tiny_model_config(tok_dir)
    if cfg.multilingual:
        model_cfg = multilingual_config(model_cfg)
    return _random_model(_model_class(cfg), model_cfg, cfg, calibrate_blank_bias)


def _random_model(model_cls, model_cfg, cfg: STTConfig, calibrate):
    """Build a random-weight model from ``model_cfg`` (seeded), condition its joint and set the
    blank bias: ``cfg.blank_bias``, or the one ``calibrate(model)`` finds for ~0.3 tokens/frame."""
    torch.manual_seed(cfg.seed)
    model = model_cls(cfg=model_cfg, trainer=None)
    model = model.to(cfg.device).eval()
    model.encoder.set_default_att_context_size(context_size(model, cfg))
    condition_random_joint(model)
    if cfg.blank_bias is None:
        bias, rate = calibrate(model)
        model._gapless_calibration = {"blank_bias": bias, "tokens_per_frame": rate}
    else:
        set_blank_bias(model, cfg.blank_bias)
    return model


def load_real_model(name_or_path: str, device: str = "cpu"):
    """Restore a pretrained .nemo: a local path, or an HF id already in the local cache."""
    _silence_nemo()
    from nemo.collections.asr.models import ASRModel

    path = name_or_path
    if not (os.path.isfile(path) and path.endswith(".nemo")):
        from pipeline.runtime.weights import require_pretrained

        local = require_pretrained(name_or_path, what="STT", allow_patterns=["*.nemo"])
        if os.path.isdir(local):
            found = sorted(
                os.path.join(root, f) for root, _, files in os.walk(local) for f in files if f.endswith(".nemo")
            )
            if not found:
                from pipeline.runtime.weights import MissingCheckpointError

                raise MissingCheckpointError(f"STT checkpoint {name_or_path!r}: no .nemo file under {local}")
            local = found[0]
        path = local
    model = ASRModel.restore_from(path, map_location=torch.device(device))
    return model.to(device).eval()



def load_model(cfg: STTConfig):
    if cfg.profile == "tiny":
        model = build_tiny_model(cfg)  # built and calibrated in float32
    elif cfg.profile == "full":
        model = build_shaped_model("full", cfg)
    else:
        model = load_real_model(cfg.model, cfg.device)
        model.encoder.set_default_att_context_size(context_size(model, cfg))
        if cfg.blank_bias:
            set_blank_bias(model, cfg.blank_bias)
    return model.to(getattr(torch, cfg.dtype))


# ---------------------------------------------------------------------------------------------
# Bigger random-weight shapes (benchmarks): the 114 M "FastConformer large streaming" and the
# 617 M nemotron-speech-streaming-0.6b shape. Same construction and calibration as the tiny model.
MODEL_SHAPES = {
    "tiny": dict(n_layers=2, d_model=64, n_heads=4, ff=2, sub_ch=64, features=80, pred=64, pred_layers=2,
                 joint=64, vocab=128, max_symbols=2),
    # max_symbols 2 (not the real configs' 10): a random joint ignores the prediction net, so every
    # emitting frame repeats its token max_symbols times; with 10 the calibration could not get below
    # ~1.5 tokens/frame on the benchmark audio. 2 bounds the repeat like the tiny shape does.
    "large": dict(n_layers=17, d_model=512, n_heads=8, ff=4, sub_ch=256, features=80, pred=640, pred_layers=1,
                  joint=640, vocab=1024, max_symbols=2),
    "full": dict(n_layers=24, d_model=1024, n_heads=8, ff=4, sub_ch=256, features=128, pred=640, pred_layers=2,
                 joint=640, vocab=1024, max_symbols=2),
}


def shaped_model_config(tokenizer_dir: str, shape: str):
    """The tiny config with the layer sizes of ``MODEL_SHAPES[shape]``."""
    s = MODEL_SHAPES[shape]
    cfg = tiny_model_config(tokenizer_dir, d_model=s["d_model"], n_layers=s["n_layers"], max_symbols=s["max_symbols"])
    cfg.model_defaults.pred_hidden = s["pred"]
    cfg.model_defaults.joint_hidden = s["joint"]
    cfg.preprocessor.features = s["features"]
    cfg.encoder.feat_in = s["features"]
    cfg.encoder.n_heads = s["n_heads"]
    cfg.encoder.ff_expansion_factor = s["ff"]
    cfg.encoder.subsampling_conv_channels = s["sub_ch"]
    cfg.decoder.prednet.pred_hidden = s["pred"]
    cfg.decoder.prednet.pred_rnn_layers = s["pred_layers"]
    cfg.joint.jointnet.joint_hidden = s["joint"]
    return cfg


def build_shaped_model(shape: str, cfg: STTConfig):
    """A random-weight EncDecRNNTBPEModel of ``MODEL_SHAPES[shape]``, conditioned and calibrated to
    ~0.3 tokens per encoder frame like the tiny model (``cfg`` gives device, seed, lookahead, cache dir)."""
    if shape == "tiny":
        return build_tiny_model(cfg)
    _silence_nemo()
    tok_dir = tiny_tokenizer_dir(cfg.cache_dir, vocab_size=MODEL_SHAPES[shape]["vocab"], multilingual=cfg.multilingual)
    model_cfg = shaped_model_config(tok_dir, shape)
    if cfg.multilingual:
        model_cfg = multilingual_config(model_cfg)
    return _random_model(_model_class(cfg), model_cfg, cfg, calibrate_blank_bias_cached)
