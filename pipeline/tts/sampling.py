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


class Race:
    """One frame's draws for B rows (per-row temperature, one ``top_k``), set up once per frame.

    ``argmax(p / E)`` over the candidates is ``argmax(z / t - log E)`` for logits ``z`` (the
    softmax's normalizer does not move an argmax), so a draw is a scale, a subtraction and an
    argmax, with ``1 / t`` and ``log E`` computed once for all 32 codebooks of the frame. A row at
    temperature <= 0 gets scale 1 and no noise: its draw is the argmax. All on the device, no host
    sync; ``noise`` [B, K, width] from :func:`race_noise`, or None: every row greedy."""

    def __init__(self, temperature: torch.Tensor, top_k: int, n_valid: int, noise: torch.Tensor | None):
        self.n_valid = n_valid
        self.top_k = top_k if 0 < top_k < n_valid else 0
        self.log_noise = None
        if noise is not None:
            t = temperature.view(-1, 1, 1).float()
            sampled = t > 0
            self.scale = torch.where(sampled, 1.0 / t.clamp_min(1e-6), 1.0)[:, 0]  # [B, 1]
            self.log_noise = torch.where(sampled, noise.log(), 0.0)  # [B, K, width]

    def draw(self, logits: torch.Tensor, i: int) -> torch.Tensor:
        """[B, V] logits of codebook ``i`` -> [B, 1] tokens among the first ``n_valid`` entries."""
        z = logits[..., : self.n_valid]
        if self.log_noise is None:
            return z.argmax(dim=-1, keepdim=True)
        idx = None
        if self.top_k:  # the race then runs over the top k only
            z, idx = torch.topk(z, self.top_k, dim=-1, sorted=False)
        choice = (z.float() * self.scale - self.log_noise[:, i]).argmax(dim=-1, keepdim=True)
        return choice if idx is None else idx.gather(-1, choice)
