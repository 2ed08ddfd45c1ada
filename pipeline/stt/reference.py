"""The offline reference: a model's own full-utterance pass (NeMo's preprocessor, encoder and
greedy batch decoding), which the streaming engine's tokens must equal."""
from __future__ import annotations

import numpy as np
import torch


def offline_tokens(model, pcm: np.ndarray) -> list[int]:
    """Reference: the model's own full-utterance pass (mel, encoder, NeMo greedy batch decoding)."""
    return offline_tokens_and_frames(model, pcm)[0]


@torch.inference_mode()
def offline_tokens_and_frames(model, pcm: np.ndarray) -> tuple[list[int], list[int]]:
    """The reference pass's tokens and the encoder frame NeMo's decoder emitted each on."""
    x = torch.as_tensor(np.asarray(pcm, np.float32)).unsqueeze(0)
    dev = next(model.parameters()).device
    x = x.to(dev)
    n = torch.tensor([x.shape[1]], device=dev)
    feats, feat_len = model.preprocessor(input_signal=x, length=n)
    enc, enc_len = model.encoder(audio_signal=feats, length=feat_len)
    hyp = model.decoding.rnnt_decoder_predictions_tensor(
        encoder_output=enc, encoded_lengths=enc_len, return_hypotheses=True
    )[0]
    return [int(t) for t in hyp.y_sequence], [int(t) for t in hyp.timestamp]


def encoder_frames(num_samples: int) -> int:
    """Encoder frames of an utterance of ``num_samples`` at 16 kHz (10 ms mel hop, 8x subsampling)."""
    mel = num_samples // 160 + 1
    return 1 + (mel - 1) // 8
