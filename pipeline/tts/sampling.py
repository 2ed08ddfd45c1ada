"""Token sampling for CSM, batched over streams with per-row settings, on the device.

A frame's 32 tokens are drawn by the exponential race: ``argmax(p / E)`` with ``E ~ Exp(1)`` is a
draw from ``p``. The race noise is made outside the model step by :func:`race_noise`, a
counter-based generator: row ``b``'s noise is a pure function of (its seed, its frame counter),
so a stream draws exactly the same numbers alone or in a batch, whichever rows sit beside it and
whenever it joined (batch invariance), with one batched computation per step, no per-stream
generator object and no host sync.
"""
from __future__ import annotations

import torch

# splitmix64 (Steele, Lea, Flood 2014): its increment and finalizer constants, as signed int64
_GOLDEN = 0x9E3779B97F4A7C15 - (1 << 64)
_MIX1 = 0xBF58476D1CE4E5B9 - (1 << 64)
_MIX2 = 0x94D049BB133111EB - (1 << 64)


def race_width(top_k: int, n_valid: int) -> int:
    """Entries a sampler draws among: ``top_k`` when it cuts, else all ``n_valid``."""
    return top_k if 0 < top_k < n_valid else n_valid


def _shift_right(x: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 bit patterns (torch's ``>>`` on int64 is arithmetic)."""
    return (x >> s) & ((1 << (64 - s)) - 1)


def _mix(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's finalizer: int64 in, well-mixed int64 out (multiplication wraps mod 2^64)."""
    x = (x ^ _shift_right(x, 30)) * _MIX1
    x = (x ^ _shift_right(x, 27)) * _MIX2
    return x ^ _shift_right(x, 31)


def race_noise(seeds: torch.Tensor, counters: torch.Tensor, k: int, width: int) -> torch.Tensor:
    """Exp(1) noise [B, k, width] for one frame of each row: row b from (seeds[b], counters[b]) only.

    ``seeds`` and ``counters`` are int64 [B] on the device (a stream's seed, its frame index)."""
    key = _mix(seeds * _GOLDEN + _mix(counters + _GOLDEN))  # [B]
    idx = torch.arange(k * width, device=seeds.device, dtype=torch.long).view(1, k, width)
    bits = _mix(key.view(-1, 1, 1) + (idx + 1) * _GOLDEN)
    u = (_shift_right(bits, 40).float() + 0.5) * (1.0 / (1 << 24))  # 24 bits -> uniform in (0, 1)
    return -torch.log(u)


def sample_token(logits: torch.Tensor, temperature: torch.Tensor, top_k: int, n_valid: int,
                 noise: torch.Tensor | None) -> torch.Tensor:
    """[B, V] logits -> [B, 1] tokens among the first ``n_valid`` entries, without a host sync.

    ``temperature`` [B]: rows at or below 0 take the argmax. ``noise`` [B, width]
    (:func:`race_noise`); ``None`` makes every row greedy. ``top_k`` (0: off) is one width for
    all rows, so the step keeps static shapes."""
    logits = logits[..., :n_valid]
    greedy = logits.argmax(dim=-1, keepdim=True)
    if noise is None:
        return greedy
    if 0 < top_k < n_valid:  # draw among the top k only: the race below then runs over k entries
        logits, idx = torch.topk(logits, top_k, dim=-1, sorted=False)
    else:
        idx = None
    t = temperature.view(-1, 1)
    probs = torch.softmax(logits.float() / t.clamp_min(1e-6), dim=-1)
    choice = (probs / noise).argmax(dim=-1, keepdim=True)
    if idx is not None:
        choice = idx.gather(-1, choice)
    return torch.where(t > 0, choice, greedy)
