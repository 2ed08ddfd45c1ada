"""The offline reference: a model's own full-utterance pass (NeMo's preprocessor, encoder and
greedy batch decoding), which the streaming engine's tokens must equal."""
from __future__ import annotations

import numpy as np
import torch


def offline_tokens(model, pcm: np.ndarray, language: str | None = None) -> list[int]:
    """Reference: the model's own full-utterance pass (mel, encoder, NeMo greedy batch decoding)."""
    return offline_tokens_and_frames(model, pcm, language)[0]


def encode(model, feats: torch.Tensor, feat_len: torch.Tensor, language: str | None = None):
    """The model's own forward from mel features to the joint's input, [B, D, T]: the encoder, and
    for a language-prompted model its prompt (``language``, or the model's default) through NeMo's
    ``prompt_kernel``, as NeMo's ``forward`` applies it."""
    from pipeline.stt.languages import Languages

    langs = Languages.of(model)
    if not langs.prompted:
        return model.forward(processed_signal=feats, processed_signal_length=feat_len)
    prompt = torch.full((feats.shape[0],), langs.index(language), dtype=torch.long, device=feats.device)
    return model.forward(processed_signal=feats, processed_signal_length=feat_len, prompt_indices=prompt)


@torch.inference_mode()
def offline_tokens_and_frames(model, pcm: np.ndarray, language: str | None = None) -> tuple[list[int], list[int]]:
    """The reference pass's tokens and the encoder frame NeMo's decoder emitted each on."""
    x = torch.as_tensor(np.asarray(pcm, np.float32)).unsqueeze(0)
    dev = next(model.parameters()).device
    x = x.to(dev)
    n = torch.tensor([x.shape[1]], device=dev)
    feats, feat_len = model.preprocessor(input_signal=x, length=n)
    enc, enc_len = encode(model, feats, feat_len, language)
    hyp = model.decoding.rnnt_decoder_predictions_tensor(
        encoder_output=enc, encoded_lengths=enc_len, return_hypotheses=True
    )[0]
    return [int(t) for t in hyp.y_sequence], [int(t) for t in hyp.timestamp]


def encoder_frames(num_samples: int) -> int:
    """Encoder frames of an utterance of ``num_samples`` at 16 kHz (10 ms mel hop, 8x subsampling)."""
    mel = num_samples // 160 + 1
    return 1 + (mel - 1) // 8
