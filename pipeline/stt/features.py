"""Mel features of a batch of audio chunks: NeMo's ``AudioToMelSpectrogramPreprocessor``, faster.

The engine computes each chunk's features from raw audio with a little left context (see
``engine.py``); this module is the one preprocessor call per step for the whole batch.
"""
from __future__ import annotations

import torch


class ChunkFeatures:
    """``preprocessor(input_signal, length)[0]``, bitwise equal: NeMo's ops with a cheaper STFT magnitude,
    and no length masks for a batch of full-length rows (the caller says so with ``full``)."""

    def __init__(self, preprocessor):
        self.preprocessor = preprocessor
        self.fast = self._fast_ok()

    def _fast_ok(self) -> bool:
        f = self.preprocessor.featurizer
        return (
            type(f).__name__ == "FilterbankFeatures"
            and not f.training
            and not self.preprocessor.training
            and getattr(f, "stft_pad_amount", None) is None
            and not getattr(f, "exact_pad", False)
            and not getattr(f, "use_grads", False)
            and getattr(f, "frame_splicing", 1) == 1
            and (not f.normalize or str(f.normalize).lower() in ("na", "none"))  # normalize_batch: identity
            and f.pad_to == 0
            and bool(f.log)
            and f.log_zero_guard_type in ("add", "clamp")
            and int(f.n_fft) % 2 == 0
        )

    def __call__(self, x: torch.Tensor, x_len: torch.Tensor, full: bool = False) -> torch.Tensor:
        """``model.preprocessor(x, x_len)[0]``, op for op, except the STFT magnitude: NeMo's
        ``sqrt(view_as_real(s).pow(2).sum(-1))`` reduces a size-2 inner dim (slow on CPU); re*re + im*im
        is the same two-term float sum, so the features are bitwise equal. ``full`` (every row is
        known on the host to be as long as the batch): the two length masks are skipped; they then only
        touch the last frame, which lies past every chunk's frames (the engine reads frames < len // hop)."""
        if not self.fast:
            return self.preprocessor(input_signal=x, length=x_len)[0]
        f = self.preprocessor.featurizer
        x = x.to(torch.float32)
        seq_len = torch.floor_divide(x_len + f.n_fft // 2 * 2 - f.n_fft, f.hop_length).to(torch.long)
        seq_len = torch.where(x_len == 0, torch.zeros_like(seq_len), seq_len)
        if f.preemph is not None:
            x = torch.cat((x[:, 0].unsqueeze(1), x[:, 1:] - f.preemph * x[:, :-1]), dim=1)
            if not full:
                timemask = torch.arange(x.shape[1], device=x.device).unsqueeze(0) < x_len.unsqueeze(1)
                x = x.masked_fill(~timemask, 0.0)
        s = torch.view_as_real(f.stft(x))
        re, im = s[..., 0], s[..., 1]
        x = torch.sqrt(re * re + im * im)
        if f.mag_power != 1.0:
            x = x.pow(f.mag_power)
        x = torch.matmul(f.fb.to(x.dtype), x)
        if f.log_zero_guard_type == "add":
            x = torch.log(x + f.log_zero_guard_value_fn(x))
        else:
            x = torch.log(torch.clamp(x, min=f.log_zero_guard_value_fn(x)))
        if not full:
            mask = torch.arange(x.size(-1), device=x.device).repeat(x.size(0), 1) >= seq_len.unsqueeze(1)
            x = x.masked_fill(mask.unsqueeze(1), f.pad_value)
        return x.to(self.preprocessor.dtype_sentinel_tensor.dtype)
