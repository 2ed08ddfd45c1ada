"""Sesame CSM in plain torch, gpt-fast style: static KV caches, fixed-shape per-frame steps.

CSM generates one 80 ms Mimi frame (32 codebook tokens) per backbone position:

* the **backbone** (Llama-3.2 shape) reads the sequence, one position per text token or audio
  frame (a position's embedding is the sum of its 32 audio-codebook embeddings and/or its text
  embedding); its last hidden state gives codebook 0 through ``codebook0_head``;
* the **depth decoder** (a small Llama) then runs over ``[proj(h), proj(emb(c0)), ...,
  proj(emb(c30))]`` and predicts codebook ``i`` from position ``i`` with its own head
  ``audio_head[i - 1]``. Its KV cache (32 positions) is simply overwritten every frame.

Weights and the layout of rotary embeddings follow transformers' ``CsmForConditionalGeneration``
(q/k/v and gate/up projections are fused here: :func:`map_hf_state_dict` concatenates them).
Sampling (temperature, top-k, exponential-race draw, :mod:`pipeline.tts.sampling`) stays on the
device: no host sync per token. The caches hold one row per stream: many streams step together.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from pipeline.tts.sampling import Race


@dataclass
class TransformerArch:
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    ffn_dim: int
    head_dim: int | None = None
    norm_eps: float = 1e-5
    rope: dict = field(default_factory=lambda: {"rope_type": "default", "rope_theta": 500000.0})

    def __post_init__(self):
        if self.head_dim is None:
            self.head_dim = self.dim // self.n_heads


@dataclass
class CSMArch:
    backbone: TransformerArch
    decoder: TransformerArch
    text_vocab: int
    audio_vocab: int = 2051  # per codebook; Mimi uses the first 2048 entries
    num_codebooks: int = 32


LLAMA3_ROPE = {
    "rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0,
    "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192,
}


def tiny_arch(text_vocab: int) -> CSMArch:
    """A small CSM with the real one's structure (32 codebooks of 2051, llama3 RoPE, GQA)."""
    return CSMArch(
        backbone=TransformerArch(dim=128, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=256, rope=dict(LLAMA3_ROPE)),
        decoder=TransformerArch(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, rope=dict(LLAMA3_ROPE)),
        text_vocab=text_vocab,
    )


def arch_from_hf_config(cfg) -> CSMArch:
    """Our architecture from a transformers ``CsmConfig`` (e.g. the CSM-1B checkpoint's)."""

    def tr(c) -> TransformerArch:
        return TransformerArch(
            dim=c.hidden_size, n_layers=c.num_hidden_layers, n_heads=c.num_attention_heads,
            n_kv_heads=c.num_key_value_heads, ffn_dim=c.intermediate_size, head_dim=c.head_dim,
            norm_eps=c.rms_norm_eps, rope=dict(c.rope_parameters),
        )

    return CSMArch(backbone=tr(cfg), decoder=tr(cfg.depth_decoder_config), text_vocab=cfg.text_vocab_size,
                   audio_vocab=cfg.vocab_size, num_codebooks=cfg.num_codebooks)


def rope_inv_freq(head_dim: int, rope: dict) -> torch.Tensor:
    """Inverse frequencies, default or Llama-3 scaled (as transformers computes them)."""
    base = float(rope.get("rope_theta", 500000.0))
    inv = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if rope.get("rope_type", "default") == "default":
        return inv
    if rope["rope_type"] != "llama3":
        raise ValueError(f"unsupported rope_type {rope['rope_type']!r}")
    factor, lo, hi = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old = rope["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > old / lo, inv / factor, inv)
    smooth = (old / wavelen - lo) / (hi - lo)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old / hi) * ~(wavelen > old / lo)
    return torch.where(medium, smoothed, scaled)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(x.dtype)


def rope_tables(max_len: int, head_dim: int, rope: dict) -> torch.Tensor:
    """Per-position rotation matrices R [max_len, hd, hd] with ``x @ R[p]`` = transformers'
    ``x * cos + rotate_half(x) * sin`` (one matmul instead of six elementwise ops)."""
    freqs = torch.outer(torch.arange(max_len, dtype=torch.float32), rope_inv_freq(head_dim, rope))
    cos, sin = torch.cat((freqs, freqs), -1).cos(), torch.cat((freqs, freqs), -1).sin()
    half = head_dim // 2
    perm = torch.zeros(head_dim, head_dim)
    perm[torch.arange(half) + half, torch.arange(half)] = -1.0  # rotate_half as a matrix
    perm[torch.arange(half), torch.arange(half) + half] = 1.0
    return torch.diag_embed(cos) + perm * sin[:, None, :]


class Attention(nn.Module):
    def __init__(self, a: TransformerArch):
        super().__init__()
        self.n_heads, self.n_kv, self.hd = a.n_heads, a.n_kv_heads, a.head_dim
        self.wqkv = nn.Linear(a.dim, (a.n_heads + 2 * a.n_kv_heads) * a.head_dim, bias=False)
        self.wo = nn.Linear(a.n_heads * a.head_dim, a.dim, bias=False)
        # non-persistent buffers: static tensors that torch.compile / CUDA graphs see as module state
        self.register_buffer("k_cache", None, persistent=False)  # [rows, n_kv, max_len, hd]
        self.register_buffer("v_cache", None, persistent=False)

    def forward(self, x, rot, mask, pos, row=None):
        """``x`` [B, T, D] at cache positions ``pos`` ([B or 1, T] long), ``rot`` its rotations
        [B or 1, T, hd, hd], ``mask`` [B or 1, 1, T, max_len]. ``row`` None: batch row b is cache row
        b (a prefix of the cache, a view: no copy); ``row`` [1] long: the one cache row of a
        single-row call (a prompt prefill into a stream's slot). ``pos`` an int: every row at
        positions ``pos .. pos + T - 1`` (the depth decoder), written by slicing."""
        b, t, _ = x.shape
        h = self.n_heads + self.n_kv
        qkv = self.wqkv(x).view(b, t, h + self.n_kv, self.hd)
        qk = (qkv[:, :, :h] @ rot).transpose(1, 2)  # rotary on q and k at once
        q, k = qk[:, : self.n_heads], qk[:, self.n_heads :]
        v = qkv[:, :, h:].transpose(1, 2)
        if row is None:
            kc, vc = self.k_cache[:b], self.v_cache[:b]
        if isinstance(pos, int):  # the same positions in every row: a slice of the cache, no index
            kc[:, :, pos : pos + t] = k
            vc[:, :, pos : pos + t] = v
        elif row is None:  # each row writes its own positions
            where = pos.view(-1, 1, t, 1).expand(b, self.n_kv, t, self.hd)
            kc.scatter_(2, where, k)
            vc.scatter_(2, where, v)
        else:
            heads = torch.arange(self.n_kv, device=x.device).view(1, -1, 1)
            where = (row.view(1, 1, 1), heads, pos.view(1, 1, t))
            self.k_cache.index_put_(where, k)
            self.v_cache.index_put_(where, v)
            kc, vc = self.k_cache.index_select(0, row), self.v_cache.index_select(0, row)
        y = F.scaled_dot_product_attention(q, kc, vc, attn_mask=mask, enable_gqa=self.n_heads != self.n_kv)
        return self.wo(y.transpose(1, 2).reshape(b, t, self.n_heads * self.hd))


class Block(nn.Module):
    def __init__(self, a: TransformerArch):
        super().__init__()
        self.attn_norm = RMSNorm(a.dim, a.norm_eps)
        self.attn = Attention(a)
        self.mlp_norm = RMSNorm(a.dim, a.norm_eps)
        self.w13 = nn.Linear(a.dim, 2 * a.ffn_dim, bias=False)  # gate | up
        self.w2 = nn.Linear(a.ffn_dim, a.dim, bias=False)

    def forward(self, x, rot, mask, pos, row=None):
        x = x + self.attn(self.attn_norm(x), rot, mask, pos, row)
        gate, up = self.w13(self.mlp_norm(x)).chunk(2, dim=-1)
        return x + self.w2(F.silu(gate) * up)


class Transformer(nn.Module):
    """Llama decoder over a static KV cache: ``rows`` independent sequences of ``max_len`` positions."""

    def __init__(self, a: TransformerArch):
        super().__init__()
        self.arch = a
        self.layers = nn.ModuleList(Block(a) for _ in range(a.n_layers))
        self.norm = RMSNorm(a.dim, a.norm_eps)
        self.max_len = 0

    def setup_cache(self, rows: int, max_len: int, device, dtype) -> None:
        a = self.arch
        for layer in self.layers:
            shape = (rows, a.n_kv_heads, max_len, a.head_dim)
            layer.attn.k_cache = torch.zeros(shape, device=device, dtype=dtype)
            layer.attn.v_cache = torch.zeros(shape, device=device, dtype=dtype)
        self.rot = rope_tables(max_len, a.head_dim, a.rope).to(device=device, dtype=dtype)
        self.causal = torch.ones(max_len, max_len, dtype=torch.bool, device=device).tril()
        self.positions = torch.arange(max_len, device=device)
        self.max_len = max_len

    def forward(self, x: torch.Tensor, pos: torch.Tensor, row: torch.Tensor | None = None) -> torch.Tensor:
        """x [B, T, D] at positions ``pos`` ([B or 1, T] long: data, not Python ints, so a compiled
        step has one graph for every position) -> normed hidden states [B, T, D]. Each row attends
        to its own cache row up to its own position (see :meth:`Attention.forward` for ``row``)."""
        rot = self.rot[pos]  # [B, T, hd, hd]
        mask = self.causal[pos].unsqueeze(1)  # [B, 1, T, max_len]
        for layer in self.layers:
            x = layer(x, rot, mask, pos, row)
        return self.norm(x)

    def forward_at(self, x: torch.Tensor, start: int) -> torch.Tensor:
        """``x`` [B, T, D] with every row at positions ``start .. start + T - 1`` (Python ints: the
        depth decoder, whose rows all stand at the same codebook) -> normed hidden states [B, T, D].
        The same as :meth:`forward` at ``span(start, T)``, with slices of the tables and the cache
        instead of gathers and scatters (fewer ops per depth step, where the CPU step's time goes)."""
        t = x.shape[1]
        if start + t > self.max_len:
            raise ValueError(f"sequence position {start + t} beyond the KV cache ({self.max_len})")
        rot = self.rot[start : start + t].unsqueeze(0)  # [1, T, hd, hd]
        mask = self.causal[start : start + t].view(1, 1, t, self.max_len)
        for layer in self.layers:
            x = layer(x, rot, mask, start)
        return self.norm(x)

    def span(self, start: int, length: int) -> torch.Tensor:
        """Positions ``start .. start + length - 1`` as a [1, length] tensor (shared by all rows)."""
        if start + length > self.max_len:
            raise ValueError(f"sequence position {start + length} beyond the KV cache ({self.max_len})")
        return self.positions[start : start + length].view(1, length)


class CSM(nn.Module):
    """Backbone + depth decoder. Call :meth:`setup_caches` once before generating.

    The caches hold ``rows`` independent streams (one per engine slot). The per-frame step
    (:meth:`frame_fn`) runs rows ``0 .. W-1`` together, each at its own position."""

    def __init__(self, arch: CSMArch):
        super().__init__()
        self.arch = arch
        b, d, k, v = arch.backbone, arch.decoder, arch.num_codebooks, arch.audio_vocab
        self.text_embeddings = nn.Embedding(arch.text_vocab, b.dim)
        self.audio_embeddings = nn.Embedding(k * v, b.dim)  # shared by backbone and depth decoder
        self.backbone = Transformer(b)
        self.decoder = Transformer(d)
        self.projection = nn.Linear(b.dim, d.dim, bias=False)
        self.codebook0_head = nn.Linear(b.dim, v, bias=False)
        self.audio_head = nn.Parameter(torch.empty(k - 1, d.dim, v))
        self.n_valid = v  # tokens a sampler may draw (Mimi's codebook size)
        self.register_buffer("offsets", torch.arange(k) * v, persistent=False)

    def init_random(self, seed: int, std: float = 0.02) -> "CSM":
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, p in self.named_parameters():
                if name.endswith("norm.weight"):
                    p.fill_(1.0)
                else:
                    p.copy_(torch.randn(p.shape, generator=g, device="cpu").mul_(std))
        return self

    @property
    def max_seq_len(self) -> int:
        return self.backbone.max_len

    def setup_caches(self, max_seq_len: int, rows: int = 1) -> None:
        p = next(self.parameters())
        self.backbone.setup_cache(rows, max_seq_len, p.device, p.dtype)
        self.decoder.setup_cache(rows, self.arch.num_codebooks, p.device, p.dtype)
        self.offsets = self.offsets.to(p.device)

    # -- embeddings ---------------------------------------------------------------------------
    def embed(self, tokens: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """[B, T, K+1] tokens (K audio columns, then text) with a same-shaped bool mask -> [B, T, D]."""
        k = self.arch.num_codebooks
        audio = self.audio_embeddings(tokens[..., :k] + self.offsets)  # [B, T, K, D]
        text = self.text_embeddings(tokens[..., k:])  # [B, T, 1, D]
        m = mask.unsqueeze(-1).to(audio.dtype)
        return (audio * m[..., :k, :]).sum(2) + (text * m[..., k:, :]).sum(2)

    def embed_frame(self, codes: torch.Tensor) -> torch.Tensor:
        """[B, K] audio codes -> [B, 1, D]: the backbone input of a generated frame."""
        return self.audio_embeddings(codes + self.offsets).sum(1, keepdim=True)

    # -- backbone -----------------------------------------------------------------------------
    def prefill(self, tokens: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Run a prompt at positions 0..T-1 in cache rows 0..B-1; returns the last hidden [B, D]."""
        return self.backbone(self.embed(tokens, mask), self.backbone.span(0, tokens.shape[1]))[:, -1]

    def prefill_at(self, tokens: torch.Tensor, mask: torch.Tensor, last: torch.Tensor,
                   row: torch.Tensor) -> torch.Tensor:
        """One prompt ([1, T, K+1], padded at the END to a bucket length) into cache row ``row``
        ([1] long); returns the hidden state of row ``last`` ([1] long, the last real row), [1, D].

        Equal to :meth:`prefill` of the unpadded prompt: pad rows sit after every real row, so the
        causal mask hides them from the real rows; generation then starts at position ``last + 1``
        and overwrites their cache entries one by one (each is masked until overwritten)."""
        pos = self.backbone.span(0, tokens.shape[1])
        return self.backbone(self.embed(tokens, mask), pos, row).index_select(1, last)[:, 0]

    def backbone_step(self, codes: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """Feed one generated frame per row ([B, K]) at positions ``pos`` ([B] long); hidden [B, D]."""
        return self.backbone(self.embed_frame(codes), pos.view(-1, 1))[:, -1]

    def c0_logits(self, h: torch.Tensor) -> torch.Tensor:
        return self.codebook0_head(h)

    # -- depth decoder ------------------------------------------------------------------------
    def depth_logits(self, h: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
        """Teacher-forced: backbone hidden [B, D] + codes c0..c_{n-1} [B, n] -> logits of c1..c_n [B, n, V]."""
        n = codes.shape[1]
        emb = self.audio_embeddings(codes + self.offsets[:n])
        x = self.decoder(self.projection(torch.cat([h.unsqueeze(1), emb], dim=1)), self.decoder.span(0, n + 1))
        return torch.einsum("bnd,ndv->bnv", x[:, 1:], self.audio_head[:n])

    def sample_frame(self, h: torch.Tensor, temperature: torch.Tensor | float, top_k: int,
                     noise: torch.Tensor | None = None) -> torch.Tensor:
        """One frame from backbone hidden ``h`` [B, D]: c0, then 31 depth steps. Returns [B, K] on device.

        ``temperature``: per row [B] (or one float); ``noise`` [B, K, width] (:func:`race_noise`),
        ``None``: greedy."""
        k = self.arch.num_codebooks
        if not isinstance(temperature, torch.Tensor):
            temperature = torch.full((h.shape[0],), float(temperature), device=h.device)
        race = Race(temperature, top_k, self.n_valid, noise)  # the per-frame part of sampling, once
        c = race.draw(self.c0_logits(h), 0)
        out = [c]
        x = self.projection(torch.stack([h, self.audio_embeddings(c[:, 0])], dim=1))
        for i in range(1, k):
            y = self.decoder.forward_at(x, 0 if i == 1 else i)[:, -1]
            c = race.draw(y @ self.audio_head[i - 1], i)
            out.append(c)
            if i < k - 1:
                x = self.projection(self.audio_embeddings(c + self.offsets[i]))
        return torch.cat(out, dim=1)

    # -- the per-frame step: a fixed-shape function of tensors only (what torch.compile sees) ------
    def frame_fn(self, h0: torch.Tensor, first: torch.Tensor, prev_codes: torch.Tensor, pos: torch.Tensor,
                 noise: torch.Tensor | None, temperature: torch.Tensor, top_k: int) -> torch.Tensor:
        """One frame for cache rows 0..W-1 at once; returns their codes [W, K].

        Row b either starts its utterance (``first[b]``: sample from its prefill's hidden state
        ``h0[b]``) or continues it (feed its previous frame ``prev_codes[b]`` at position ``pos[b]``,
        then sample). Both kinds share one backbone call: a starting row's backbone output is
        discarded, and what it wrote at ``pos[b]`` (its first generated position) is overwritten
        by the next step before anything reads it. Rows without a stream compute and are ignored."""
        h = self.backbone_step(prev_codes, pos)
        h = torch.where(first.view(-1, 1), h0, h)
        return self.sample_frame(h, temperature, top_k, noise)


# -- checkpoints -------------------------------------------------------------------------------
def map_hf_state_dict(sd: dict[str, torch.Tensor], arch: CSMArch) -> dict[str, torch.Tensor]:
    """transformers ``CsmForConditionalGeneration`` keys -> ours (codec_model.* is dropped)."""
    out = {
        "text_embeddings.weight": sd["embed_text_tokens.weight"],
        "audio_embeddings.weight": sd.get("backbone_model.embed_tokens.embed_audio_tokens.weight",
                                          sd.get("depth_decoder.model.embed_tokens.weight")),
        "codebook0_head.weight": sd["lm_head.weight"],
        "projection.weight": sd["depth_decoder.model.inputs_embeds_projector.weight"],
        "audio_head": sd["depth_decoder.codebooks_head.weight"],
    }
    for ours, theirs, n_layers in (("backbone", "backbone_model", arch.backbone.n_layers),
                                   ("decoder", "depth_decoder.model", arch.decoder.n_layers)):
        out[f"{ours}.norm.weight"] = sd[f"{theirs}.norm.weight"]
        for i in range(n_layers):
            s, o = f"{theirs}.layers.{i}.", f"{ours}.layers.{i}."
            out[o + "attn.wqkv.weight"] = torch.cat(
                [sd[s + f"self_attn.{p}_proj.weight"] for p in ("q", "k", "v")], dim=0)
            out[o + "attn.wo.weight"] = sd[s + "self_attn.o_proj.weight"]
            out[o + "w13.weight"] = torch.cat([sd[s + "mlp.gate_proj.weight"], sd[s + "mlp.up_proj.weight"]], dim=0)
            out[o + "w2.weight"] = sd[s + "mlp.down_proj.weight"]
            out[o + "attn_norm.weight"] = sd[s + "input_layernorm.weight"]
            out[o + "mlp_norm.weight"] = sd[s + "post_attention_layernorm.weight"]
    return out


def load_csm(path_or_id: str, device: str = "cpu", dtype: torch.dtype = torch.float32) -> CSM:
    """Load a transformers-format CSM checkpoint (e.g. ``sesame/csm-1b``) into our modules."""
    import glob
    import os

    from safetensors.torch import load_file
    from transformers import CsmConfig

    from pipeline.runtime.weights import reading_checkpoint, require_pretrained

    path = require_pretrained(path_or_id, what="CSM-1B", allow_patterns=["*.json", "*.safetensors"])
    with reading_checkpoint("CSM-1B", path_or_id, path):
        arch = arch_from_hf_config(CsmConfig.from_pretrained(path))
        files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
        if not files:
            raise FileNotFoundError(f"no *.safetensors file under {path}")
        sd: dict[str, torch.Tensor] = {}
        for f in files:
            sd.update({k: v for k, v in load_file(f).items() if not k.startswith("codec_model.")})
        with torch.device("meta"):
            model = CSM(arch)
        model.load_state_dict(map_hf_state_dict(sd, arch), strict=True, assign=True)
    model.offsets = torch.arange(arch.num_codebooks) * arch.audio_vocab
    return model.to(device=device, dtype=dtype).eval()
