"""One streaming step of the cache-aware FastConformer's layers, for a batch of slots.

Two implementations behind one interface (``cache_shapes``, ``__call__``):

``NemoLayersStep`` calls NeMo's ``ConformerEncoder.forward_internal`` (``bypass_pre_encode``) with
its own cache format: per layer the last ``C`` (70) *inputs* of self-attention
(``cache_last_channel``), the convolution module's last inputs (``cache_last_time``) and the valid
cache length (``cache_last_channel_len``).

``KVCacheLayersStep`` keeps the attention keys and values of those ``C`` frames instead of the
frames themselves. NeMo's attention recomputes ``linear_k`` and ``linear_v`` over ``C + T`` frames
every step (``update_cache`` concatenates the cached inputs before ``forward_qkv``), although only
the ``T`` new frames changed: at the [70, 13] chunk that is 84 rows projected for 14 new ones,
about a third of the layer's multiply-adds. Here the new frames are projected once and the cached
projections are reused; the positional projection ``linear_pos(pos_emb)`` depends only on the
(fixed) chunk shape and is computed once per weight version. Everything else is NeMo's modules and
NeMo's order of operations (feed-forward, masks, relative-position scores, softmax, convolution
module with its cache); results equal NeMo's to float rounding (``tests/test_stt.py``).
"""
from __future__ import annotations

import torch

INF_VAL = 10000.0  # NeMo's masked-score value (multi_head_attention.INF_VAL)


def _layer_ok(layer) -> bool:
    from nemo.collections.asr.parts.submodules.causal_convs import CausalConv1D
    from nemo.collections.asr.parts.submodules.multi_head_attention import RelPositionMultiHeadAttention

    attn = getattr(layer, "self_attn", None)
    conv = getattr(layer, "conv", None)
    adapters = getattr(layer, "is_adapter_available", lambda: False)()
    dw = getattr(conv, "depthwise_conv", None)
    return (
        type(attn) is RelPositionMultiHeadAttention
        and getattr(layer, "self_attention_model", None) == "rel_pos"
        and not adapters
        and not layer.training
        and getattr(conv, "pointwise_activation", None) == "glu_"
        and getattr(conv, "norm_type", None) in ("layer_norm", "batch_norm")
        and isinstance(dw, CausalConv1D)
        and dw.groups == dw.in_channels == dw.out_channels
        and dw.stride == (1,)
        and dw.dilation == (1,)
    )


class NemoLayersStep:
    """NeMo's own layer loop with its input caches."""

    def __init__(self, enc):
        self.enc = enc

    def cache_shapes(self) -> list[tuple]:
        """Per-slot cache tensors as [L, slot, ...] shapes (slot dim 1), in the order __call__ takes them."""
        sc = self.enc.streaming_cfg
        L, d = len(self.enc.layers), self.enc.d_model
        return [(L, 1, sc.last_channel_cache_size, d), (L, 1, d, self._time_cache())]

    def _time_cache(self) -> int:
        ch, tm, _ = self.enc.get_initial_cache_state(batch_size=1)
        return tm.shape[-1]

    def positions(self, T: int) -> None:
        """Per-chunk-shape constants to pass to ``__call__`` (NeMo's loop computes its own)."""
        return None

    def __call__(self, pre, pre_len, caches: list[torch.Tensor], cache_len: torch.Tensor, pos=None):
        out = self.enc.forward_internal(
            pre,
            pre_len,
            cache_last_channel=caches[0],
            cache_last_time=caches[1],
            cache_last_channel_len=cache_len,
            bypass_pre_encode=True,
        )
        enc_out, enc_len, ch, tm, ch_len = self.enc.streaming_post_process(out, keep_all_outputs=True)
        return enc_out, enc_len, [ch, tm], ch_len


class KVCacheLayersStep(NemoLayersStep):
    """The same step with projected key/value caches (see the module docstring)."""

    @staticmethod
    def supports(enc) -> bool:
        return (
            not enc.training
            # chunked_limited: every frame of a chunk is output (no look-ahead frames to trim, as
            # "regular" has via valid_out_len) and nothing is dropped from the caches
            and enc.att_context_style == "chunked_limited"
            and enc.streaming_cfg.cache_drop_size == 0
            and getattr(enc, "reduction_position", None) is None
            and getattr(enc, "out_proj", None) is None
            and enc.streaming_cfg.last_channel_cache_size > 0
            and all(_layer_ok(layer) for layer in enc.layers)
        )

    def __init__(self, enc):
        if not self.supports(enc):
            raise ValueError("KVCacheLayersStep needs rel_pos self-attention layers without adapters, in eval")
        super().__init__(enc)
        self._pos_key = None
        self._pos: list[torch.Tensor] = []

    def cache_shapes(self) -> list[tuple]:
        sc = self.enc.streaming_cfg
        L, d = len(self.enc.layers), self.enc.d_model
        C = sc.last_channel_cache_size
        return [(L, 1, C, d), (L, 1, C, d), (L, 1, d, self._time_cache())]

    def positions(self, T: int) -> list[torch.Tensor]:
        """Per layer, ``linear_pos(pos_emb)`` as [heads, d_k, P'] for chunks of ``T`` frames after a full
        cache, cut to the P' = C + 2T - 1 relative positions the shifted scores use; recomputed when
        ``T`` or a weight changes. Call outside ``torch.compile`` (the engine does) and pass it in."""
        ws = [layer.self_attn.linear_pos.weight for layer in self.enc.layers]
        key = (T, tuple((w.data_ptr(), w._version, w.dtype, w.device) for w in ws))
        if key != self._pos_key:
            C = self.enc.streaming_cfg.last_channel_cache_size
            with torch.inference_mode():
                pos_emb = self.pos_emb(T)[0, : C + 2 * T - 1]  # [P', d]
                self._pos = []
                for layer in self.enc.layers:
                    a = layer.self_attn
                    self._pos.append(a.linear_pos(pos_emb).view(-1, a.h, a.d_k).permute(1, 2, 0).contiguous())
            self._pos_key = key
        return self._pos

    def pos_emb(self, T: int) -> torch.Tensor:
        """The relative position table NeMo's ``pos_enc`` returns for ``T`` new frames after a full cache."""
        enc = self.enc
        C = enc.streaming_cfg.last_channel_cache_size
        w = enc.layers[0].self_attn.linear_pos.weight
        x = torch.zeros(1, T, enc.d_model, dtype=w.dtype, device=w.device)
        return enc.pos_enc(x=x, cache_len=C)[1].to(w.dtype)

    def __call__(self, pre, pre_len, caches: list[torch.Tensor], cache_len: torch.Tensor, pos=None):
        enc = self.enc
        k_cache, v_cache, t_cache = caches
        C = enc.streaming_cfg.last_channel_cache_size
        B, T, _ = pre.shape
        if pos is None:
            pos = self.positions(T)
        x, _ = enc.pos_enc(x=pre, cache_len=C)  # xscaling (the table is in `pos`)
        pad_mask, att_mask = enc._create_masks(
            att_context_size=enc.att_context_size,
            padding_length=pre_len + C,
            max_audio_length=T + C,
            offset=C - cache_len,
            device=pre.device,
        )
        pad_mask, att_mask = pad_mask[:, C:], att_mask[:, C:]
        # masked scores as an additive bias: exp() of a score near -1e4 is 0 like NeMo's masked_fill
        # (a valid frame always sees itself, so no valid row is all masked); [B, 1, T, C + T]
        bias = torch.zeros(att_mask.shape, dtype=x.dtype, device=x.device).masked_fill_(att_mask, -INF_VAL)[:, None]
        ks, vs, ts = [], [], []
        for i, layer in enumerate(enc.layers):
            residual = x + layer.feed_forward1(layer.norm_feed_forward1(x)) * layer.fc_factor
            xn = layer.norm_self_att(residual)
            att, k_next, v_next = self._attention(layer.self_attn, xn, bias, pos[i], k_cache[i], v_cache[i])
            residual = residual + att
            conv, t_next = self._conv(layer.conv, layer.norm_conv(residual), pad_mask, t_cache[i])
            residual = residual + conv
            residual = residual + layer.feed_forward2(layer.norm_feed_forward2(residual)) * layer.fc_factor
            x = layer.norm_out(residual)
            ks.append(k_next)
            vs.append(v_next)
            ts.append(t_next)
        out_len = torch.clamp(cache_len + T, max=C)  # no cache drop (supports()): all T frames kept
        return x.transpose(1, 2), pre_len, [torch.stack(ks), torch.stack(vs), torch.stack(ts)], out_len

    @staticmethod
    def _attention(attn, xn, bias, p, k_cache, v_cache):
        """RelPositionMultiHeadAttention with cached key/value projections.

        The relative-position term is one matmul per head over the batch's frames ([h, B*T, d_k] x
        [h, d_k, P']) and NeMo's ``rel_shift`` (pad, reshape, drop a row) becomes a strided view:
        shifted[b, h, i, j] = raw[b, h, i, j + T - 1 - i]. Scores, mask and softmax go through one
        ``scaled_dot_product_attention`` with that term (scaled) plus the mask as its float mask."""
        B, T, _ = xn.shape
        h, dk = attn.h, attn.d_k
        k_new, v_new = attn.linear_k(xn), attn.linear_v(xn)
        k = torch.cat([k_cache, k_new], 1)
        v = torch.cat([v_cache, v_new], 1)
        S = k.shape[1]
        k_next, v_next = k[:, T:], v[:, T:]  # the last C frames (nothing dropped)
        q = attn.linear_q(xn).view(B, T, h, dk)
        q_u = (q + attn.pos_bias_u).transpose(1, 2)  # [B, h, T, dk]
        q_v = (q + attn.pos_bias_v).permute(2, 0, 1, 3).reshape(h, B * T, dk)
        P = p.shape[-1]
        raw = torch.bmm(q_v, p)  # [h, B*T, P], a new tensor: storage offset 0
        # (a literal offset: raw.storage_offset() is an int torch.compile cannot trace, a graph break
        # that made dynamo skip the whole layer loop)
        bd = raw.as_strided((B, h, T, S), (T * P, B * T * P, P - 1, 1), T - 1)
        mask = bd * (1.0 / attn.s_d_k) + bias
        out = torch.nn.functional.scaled_dot_product_attention(
            q_u, k.view(B, S, h, dk).transpose(1, 2), v.view(B, S, h, dk).transpose(1, 2), attn_mask=mask
        )
        out = attn.linear_out(out.transpose(1, 2).reshape(B, T, h * dk))
        return out, k_next, v_next

    @staticmethod
    def _conv(conv, x, pad_mask, cache):
        """ConformerConvolution (pointwise, GLU, causal depthwise with its cache, norm, Swish, pointwise)
        on [B, T, d] frames, without the transposes: the pointwise convolutions are linear layers and
        the depthwise one a sum over an unfolded window. ``cache`` stays in NeMo's [B, d, K-1] layout."""
        y = torch.nn.functional.linear(x, conv.pointwise_conv1.weight[:, :, 0], conv.pointwise_conv1.bias)
        y = torch.nn.functional.glu(y, dim=-1).masked_fill(pad_mask[:, :, None], 0.0)
        dw = conv.depthwise_conv
        if dw._right_padding:
            y = torch.nn.functional.pad(y, (0, 0, 0, dw._right_padding))
        full = torch.cat([cache.transpose(1, 2), y], 1)  # [B, K-1 + T (+ right), d]
        nxt = full[:, -cache.shape[-1] :].transpose(1, 2)  # no cache drop (supports())
        K = dw.kernel_size[0]
        y = (full.unfold(1, K, 1) * dw.weight[:, 0]).sum(-1)  # [B, T, d]
        if dw.bias is not None:  # none where the encoder is built without biases (use_bias: false)
            y = y + dw.bias
        if conv.norm_type == "layer_norm":
            y = conv.batch_norm(y)
        else:
            y = conv.batch_norm(y.transpose(1, 2)).transpose(1, 2)
        y = conv.activation(y)
        y = torch.nn.functional.linear(y, conv.pointwise_conv2.weight[:, :, 0], conv.pointwise_conv2.bias)
        return y, nxt
