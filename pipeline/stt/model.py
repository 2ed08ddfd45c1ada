"""Building the recogniser: a tiny random-weight cache-aware FastConformer RNNT, or a real .nemo."""
from __future__ import annotations

import logging
import os
import tempfile

import numpy as np
import torch

from pipeline.stt.config import LOOKAHEADS, STTConfig

SAMPLE_RATE = 16000

_TOKENIZER_TEXT = """\
the quick brown fox jumps over the lazy dog while the band plays on
she sells sea shells by the sea shore and the shells she sells are surely sea shells
how much wood would a woodchuck chuck if a woodchuck could chuck wood
a voice assistant listens to the user and answers in real time without long pauses
please tell me the weather for tomorrow morning in the city where i live
can you book a table for two people at seven in the evening
i would like to hear some music from the seventies and eighties
what time is it now and how long will it take to get to the station
the meeting has been moved to thursday afternoon after lunch
remind me to call my mother when i get home tonight
there are many reasons why streaming speech recognition is hard
every word spoken should appear on the screen as soon as possible
she opened the window and looked at the bright blue sky above the hills
we walked along the river until the sun went down behind the trees
thank you very much for your help with this problem today
good morning everyone and welcome to the first lesson of the course
numbers like one two three four five six seven eight nine ten are common
the children were playing in the garden while their parents talked
could you repeat that please i did not hear the last part
turn off the lights in the kitchen and lock the front door
"""


def _silence_nemo() -> None:
    from nemo.utils import logging as nemo_logging

    nemo_logging.setLevel(logging.ERROR)


def tiny_tokenizer_dir(cache_dir: str | None = None, vocab_size: int = 128) -> str:
    """Train (once, deterministically) a small SentencePiece BPE model; return its directory."""
    from nemo.collections.common.tokenizers.sentencepiece_tokenizer import create_spt_model

    cache_dir = cache_dir or os.path.join(os.path.expanduser("~"), ".cache", "gapless", "stt-tiny")
    out = os.path.join(cache_dir, f"spe_bpe_v{vocab_size}")
    if os.path.exists(os.path.join(out, "tokenizer.model")):
        return out
    os.makedirs(cache_dir, exist_ok=True)
    tmp = tempfile.mkdtemp(dir=cache_dir)
    text = os.path.join(tmp, "text.txt")
    with open(text, "w") as f:
        f.write(_TOKENIZER_TEXT * 4)
    create_spt_model(text, vocab_size, sample_size=-1, do_lower_case=True, tokenizer_type="bpe", output_dir=tmp)
    try:
        os.replace(tmp, out)  # atomic: a concurrent builder either wins or finds it done
    except OSError:
        pass
    return out


def tiny_model_config(tokenizer_dir: str, d_model: int = 64, n_layers: int = 2, max_symbols: int = 2):
    from omegaconf import OmegaConf

    return OmegaConf.create(
        {
            "sample_rate": SAMPLE_RATE,
            "model_defaults": {"enc_hidden": d_model, "pred_hidden": d_model, "joint_hidden": d_model},
            "tokenizer": {"dir": tokenizer_dir, "type": "bpe"},
            "preprocessor": {
                "_target_": "nemo.collections.asr.modules.AudioToMelSpectrogramPreprocessor",
                "sample_rate": SAMPLE_RATE,
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


def _joint_out_linear(model) -> torch.nn.Linear:
    return [m for m in model.joint.joint_net.modules() if isinstance(m, torch.nn.Linear)][-1]


def set_blank_bias(model, bias: float) -> None:
    """Set the extra bias on the blank logit (relative to the weights as built/loaded)."""
    lin = _joint_out_linear(model)
    base = getattr(model, "_gapless_blank_base", None)
    if base is None:
        base = float(lin.bias[model.decoder.blank_idx])
        model._gapless_blank_base = base
    with torch.no_grad():
        lin.bias[model.decoder.blank_idx] = base + float(bias)
    model._gapless_blank_bias = float(bias)


def speech_like_audio(seconds: float, seed: int = 0) -> np.ndarray:
    """Deterministic synthetic 'speech': voiced syllables (harmonics + formant-ish peaks), noise, pauses."""
    rng = np.random.default_rng(seed)
    n = int(seconds * SAMPLE_RATE)
    out = np.zeros(n, np.float32)
    pos = 0
    while pos < n:
        dur = int(rng.uniform(0.12, 0.3) * SAMPLE_RATE)
        seg = min(dur, n - pos)
        t = np.arange(seg) / SAMPLE_RATE
        f0 = rng.uniform(90, 220) * (1 + 0.1 * np.sin(2 * np.pi * rng.uniform(1, 4) * t))
        phase = 2 * np.pi * np.cumsum(f0) / SAMPLE_RATE
        formants = rng.uniform([300, 900, 2200], [900, 2200, 3200])
        sig = np.zeros(seg)
        for h in range(1, 30):
            fh = f0 * h
            amp = sum(np.exp(-(((fh - fm) / 150.0) ** 2)) for fm in formants) + 0.02
            sig += amp * np.sin(h * phase)
        sig += 0.3 * rng.standard_normal(seg) * (rng.random() < 0.3)  # fricative-ish
        env = np.sin(np.pi * np.arange(seg) / seg) ** 0.5
        out[pos : pos + seg] = (0.1 * sig * env).astype(np.float32)
        pos += seg + int(rng.uniform(0.0, 0.12) * SAMPLE_RATE)
    return np.clip(out, -1, 1)


@torch.inference_mode()
def offline_tokens(model, pcm: np.ndarray) -> list[int]:
    """Reference: the model's own full-utterance pass (mel, encoder, NeMo greedy batch decoding)."""
    x = torch.as_tensor(np.asarray(pcm, np.float32)).unsqueeze(0)
    dev = next(model.parameters()).device
    x = x.to(dev)
    n = torch.tensor([x.shape[1]], device=dev)
    feats, feat_len = model.preprocessor(input_signal=x, length=n)
    enc, enc_len = model.encoder(audio_signal=feats, length=feat_len)
    hyps = model.decoding.rnnt_decoder_predictions_tensor(
        encoder_output=enc, encoded_lengths=enc_len, return_hypotheses=True
    )
    return [int(t) for t in hyps[0].y_sequence]


def encoder_frames(num_samples: int) -> int:
    mel = num_samples // 160 + 1
    return 1 + (mel - 1) // 8


@torch.inference_mode()
def condition_random_joint(model, seconds: float = 6.0, enc_scale: float = 1.5, out_scale: float = 3.0) -> None:
    """Make a random joint listen to the audio.

    A random encoder's output is mostly a constant pattern, so a random joint emits the same
    token on every frame and the blank/non-blank decision sits on a knife edge (float noise
    flips it). Standardising the joint's encoder projection on speech-like audio (removing the
    constant part) and widening the output layer gives frame-dependent decisions with margins.
    """
    pcm = speech_like_audio(seconds, seed=4321)
    dev = next(model.parameters()).device
    x = torch.as_tensor(pcm, device=dev)[None]
    feats, feat_len = model.preprocessor(input_signal=x, length=torch.tensor([x.shape[1]], device=dev))
    enc, _ = model.encoder(audio_signal=feats, length=feat_len)
    e = enc[0].T  # [T, D]
    w = model.joint.enc.weight / e.std(0).clamp(min=1e-3)[None, :] * enc_scale
    model.joint.enc.weight.copy_(w)
    model.joint.enc.bias.copy_(-(w @ e.mean(0)))
    _joint_out_linear(model).weight.mul_(out_scale)


def calibrate_blank_bias(model, target_rate: float = 0.3, seconds: float = 20.0) -> tuple[float, float]:
    """Bisect the blank bias so greedy decoding emits ~target_rate tokens/encoder frame on speech_like_audio."""
    pcm = speech_like_audio(seconds, seed=1234)
    frames = encoder_frames(len(pcm))
    return _bisect_blank_bias(model, target_rate, lambda: len(offline_tokens(model, pcm)) / frames)


def _bisect_blank_bias(model, target_rate: float, rate_now) -> tuple[float, float]:
    """Bisect the blank bias until ``rate_now()`` (tokens/frame at the bias set) is nearest the target."""
    lo, hi = -5.0, 30.0
    best = (float("inf"), 0.0, 0.0)  # (|rate - target|, bias, rate): the rate is a steep step function
    for _ in range(20):
        mid = 0.5 * (lo + hi)
        set_blank_bias(model, mid)
        rate = rate_now()
        best = min(best, (abs(rate - target_rate), mid, rate))
        if rate > target_rate:
            lo = mid
        else:
            hi = mid
    _, bias, rate = best
    set_blank_bias(model, bias)
    return bias, rate


def build_tiny_model(cfg: STTConfig):
    """A random-weight EncDecRNNTBPEModel with the cache-aware FastConformer shape, built offline."""
    _silence_nemo()
    from nemo.collections.asr.models import EncDecRNNTBPEModel

    tok_dir = tiny_tokenizer_dir(cfg.cache_dir)
    return _random_model(EncDecRNNTBPEModel, tiny_model_config(tok_dir), cfg, calibrate_blank_bias)


def _random_model(model_cls, model_cfg, cfg: STTConfig, calibrate):
    """Build a random-weight model from ``model_cfg`` (seeded), condition its joint and set the
    blank bias: ``cfg.blank_bias``, or the one ``calibrate(model)`` finds for ~0.3 tokens/frame."""
    torch.manual_seed(cfg.seed)
    model = model_cls(cfg=model_cfg, trainer=None)
    model = model.to(cfg.device).eval()
    model.encoder.set_default_att_context_size(list(cfg.att_context_size))
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
        from pipeline.weights import require_pretrained

        local = require_pretrained(name_or_path, what="STT", allow_patterns=["*.nemo"])
        if os.path.isdir(local):
            found = sorted(
                os.path.join(root, f) for root, _, files in os.walk(local) for f in files if f.endswith(".nemo")
            )
            if not found:
                from pipeline.weights import MissingCheckpointError

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
        model.encoder.set_default_att_context_size(list(cfg.att_context_size))
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


@torch.inference_mode()
def calibrate_blank_bias_cached(model, target_rate: float = 0.3, seconds: float = 20.0) -> tuple[float, float]:
    """``calibrate_blank_bias`` with the encoder run once (the bias only changes the decoding): for big shapes.

    Calibrates on several clips of 2-10 s (not one long clip): a random big encoder emits more near an
    utterance's start, so one 20 s clip calibrated to 0.3 gave ~0.7 tokens/frame on 2-5 s benchmark clips."""
    lens = [2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0, 8.0, 10.0]
    scale = seconds / sum(lens) if seconds > sum(lens) else 1.0
    clips = [speech_like_audio(s * scale, seed=1234 + i) for i, s in enumerate(lens)]
    frames = sum(encoder_frames(len(p)) for p in clips)
    dev = next(model.parameters()).device
    encs = []
    for pcm in clips:
        x = torch.as_tensor(pcm, device=dev)[None]
        feats, feat_len = model.preprocessor(input_signal=x, length=torch.tensor([x.shape[1]], device=dev))
        encs.append(model.encoder(audio_signal=feats, length=feat_len))

    def rate_now() -> float:
        n_tok = 0
        for enc, enc_len in encs:
            hyps = model.decoding.rnnt_decoder_predictions_tensor(
                encoder_output=enc, encoded_lengths=enc_len, return_hypotheses=True
            )
            n_tok += len(hyps[0].y_sequence)
        return n_tok / frames

    return _bisect_blank_bias(model, target_rate, rate_now)


def build_shaped_model(shape: str, cfg: STTConfig):
    """A random-weight EncDecRNNTBPEModel of ``MODEL_SHAPES[shape]``, conditioned and calibrated to
    ~0.3 tokens per encoder frame like the tiny model (``cfg`` gives device, seed, lookahead, cache dir)."""
    if shape == "tiny":
        return build_tiny_model(cfg)
    _silence_nemo()
    from nemo.collections.asr.models import EncDecRNNTBPEModel

    tok_dir = tiny_tokenizer_dir(cfg.cache_dir, vocab_size=MODEL_SHAPES[shape]["vocab"])
    return _random_model(EncDecRNNTBPEModel, shaped_model_config(tok_dir, shape), cfg, calibrate_blank_bias_cached)
