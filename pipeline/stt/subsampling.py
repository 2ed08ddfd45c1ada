"""The cache-aware FastConformer's causal ``dw_striding`` subsampling, as matmuls in channels-last.

NeMo's ``ConvSubsampling`` (``subsampling: dw_striding``, ``causal_downsampling: true``, factor 8) is

    CausalConv2D(1 -> C, 3x3, /2), ReLU, [CausalConv2D(C, 3x3, /2, groups=C), Conv2d(C -> C, 1x1), ReLU] x 2

with every layer's input multiplied by a time mask (``MaskedConvSequential``), then a linear layer over
``C * F'`` features per frame. On a CPU the library path is slow for three reasons: a 3x3 convolution
with one input channel leaves oneDNN's fast paths (12 ms for a 16 x 1.2 s batch of the tiny model,
~23 M multiply-adds); depthwise convolutions in NCHW are ~4x slower than in channels-last; and each
causal layer copies its input to pad it, each masked layer multiplies it by a mask.

Here the first convolution is an ``unfold`` + one matmul (output channels-last), the depthwise ones
run in channels-last with the causal left padding given to the convolution itself (the extra right
padding only adds output frames past the causal ones, which are cut off), the pointwise ones are
matmuls. The time masks are only applied when some row is shorter than the batch (the caller knows:
a last chunk), and never after the last layer: every layer is causal in time, so frames past a row's
length only reach valid ones through the last valid output of a stride-2 layer, which sees one
frame past the end; frames past the length of the output hold values NeMo would have zeroed, and
the encoder masks them out by length like any padding (attention pad mask, the convolution module's
``masked_fill``). Valid frames equal NeMo's to float rounding (different summation order; ~1e-7 on
unit-scale features), checked by ``tests/test_stt.py``.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def _out_len(n, kernel: int = 3, stride: int = 2, pad: int = 3):
    return (n + pad - kernel) // stride + 1


class CausalDwStriding:
    """Fast forward of a NeMo ``ConvSubsampling`` (causal dw_striding); ``supports(pre_encode)`` says when.

    Holds no weights of its own: it reads the module's parameters at every call (so ``model.to(dtype)``
    and weight loading after construction are seen), apart from the reshaped first-layer kernel, which
    is rebuilt whenever that parameter changes."""

    def __init__(self, pre_encode):
        if not self.supports(pre_encode):
            raise ValueError("CausalDwStriding needs NeMo's causal dw_striding subsampling (factor 8)")
        self.pe = pre_encode
        layers = list(pre_encode.conv)
        self.first = layers[0]
        self.stages = [(layers[i], layers[i + 1]) for i in (2, 5)]  # (depthwise, pointwise)
        self.channels = self.first.out_channels
        self._w0_key = None
        self._w0 = None

    @staticmethod
    def supports(pe) -> bool:
        from nemo.collections.asr.parts.submodules.causal_convs import CausalConv2D
        from nemo.collections.asr.parts.submodules.subsampling import MaskedConvSequential

        conv = getattr(pe, "conv", None)
        if not isinstance(conv, MaskedConvSequential) or pe.training or len(conv) != 8:
            return False
        if not (getattr(pe, "conv2d_subsampling", False) and getattr(pe, "_sampling_num", 0) == 3):
            return False
        if getattr(pe, "subsampling_conv_chunking_factor", 1) != 1:
            return False
        c0, a0, d1, p1, a1, d2, p2, a2 = conv
        causal = all(
            isinstance(m, CausalConv2D)
            and m.kernel_size == (3, 3)
            and m.stride == (2, 2)
            and (m._left_padding, m._right_padding) == (2, 1)
            for m in (c0, d1, d2)
        )
        point = all(isinstance(m, torch.nn.Conv2d) and m.kernel_size == (1, 1) and m.stride == (1, 1) for m in (p1, p2))
        relu = all(isinstance(m, torch.nn.ReLU) for m in (a0, a1, a2))
        C = c0.out_channels
        shapes = c0.in_channels == 1 and d1.groups == C == d2.groups and p1.in_channels == C == p2.out_channels
        biased = all(m.bias is not None for m in (c0, d1, p1, d2, p2))
        return causal and point and relu and shapes and biased

    def output_lengths(self, lengths: torch.Tensor) -> torch.Tensor:
        for _ in range(3):
            lengths = _out_len(lengths)
        return lengths

    def _first_kernel(self) -> torch.Tensor:
        w = self.first.weight
        key = (w.data_ptr(), w._version, w.dtype, w.device)
        if key != self._w0_key:
            self._w0 = w.reshape(self.channels, 9).t().contiguous()  # [9, C]
            self._w0_key = key
        return self._w0

    def __call__(
        self, x: torch.Tensor, lengths: torch.Tensor, full: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``pre_encode(x, lengths)`` for ``x`` [B, T, F] mel frames (time-major); returns ([B, T', D], T' lengths).

        ``full``: the caller knows every row is ``T`` frames long, so the time masks are skipped."""
        B, T, Fq = x.shape
        C = self.channels
        lengths = lengths.to(torch.long)
        out_lengths = self.output_lengths(lengths)
        if not full:
            x = x * (torch.arange(T, device=x.device) < lengths[:, None]).to(x.dtype)[:, :, None]
        t, f = _out_len(T), _out_len(Fq)
        patches = F.pad(x, (2, 1, 2, 1)).unfold(1, 3, 2).unfold(2, 3, 2)  # [B, t, f, 3, 3]
        h = torch.addmm(self.first.bias, patches.reshape(-1, 9), self._first_kernel()).view(B, t, f, C).relu_()
        for dw, pw in self.stages:
            if not full:  # lengths after the previous layer, for this layer's input mask
                lengths = _out_len(lengths)
                h = h * (torch.arange(t, device=h.device) < lengths[:, None]).to(h.dtype)[:, :, None, None]
            t2, f2 = _out_len(t), _out_len(f)
            y = F.conv2d(h.permute(0, 3, 1, 2), dw.weight, dw.bias, 2, 2, 1, C)[:, :, :t2, :f2]
            y = y.permute(0, 2, 3, 1).reshape(-1, C)  # channels-last rows
            h = torch.addmm(pw.bias, y, pw.weight.view(C, C).t()).view(B, t2, f2, C).relu_()
            t, f = t2, f2
        # NeMo flattens [B, C, T', F'] as (C, F') per frame
        out = self.pe.out(h.permute(0, 1, 3, 2).reshape(B, t, C * f))
        return out, out_lengths
