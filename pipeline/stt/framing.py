"""How a stream's audio is cut into the encoder's chunks: the model's streaming geometry (chunk
sizes in mel frames, the pre-encode cache, frames per encoder step) and, per stream, when a chunk
is ready and which samples it takes.

Features are computed per chunk from the raw audio with ``CTX_FRAMES`` frames of left context,
which reproduces the offline mel frames (same pre-emphasis, same centred STFT windows), so
streaming tokens equal an offline pass. ``framing="nemo"`` cuts as NeMo's own pipeline does
(every chunk full-size, one frame of context, after a pre-encode cache of silence): the baseline
the benchmarks compare against.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pipeline.audio_constants import USER_RATE
from pipeline.stt.config import STTConfig
from pipeline.stt.slots import SlotStream

CTX_FRAMES = 2  # mel frames of left audio context per chunk (window 512 > hop 160 * 2 + 1 pre-emphasis sample)


def context_size(model, cfg: STTConfig) -> list[int]:
    """``cfg.att_context_size`` where the model was trained with it; else the model's left context
    with ``cfg``'s lookahead (the multilingual model's left context is 56 frames, the English one's 70).
    ValueError when no trained context has that lookahead."""
    trained = [list(a) for a in model.encoder.att_context_size_all]
    want = list(cfg.att_context_size)
    if want in trained:
        return want
    same = [a for a in trained if a[1] == want[1]]
    if not same:
        raise ValueError(f"STTConfig.att_context_size {want}: this model streams with {trained} only")
    return same[0]


@dataclass(frozen=True)
class Framing:
    hop: int  # samples per mel frame
    half_window: int  # samples of the STFT's half window (a frame's audio reaches this far right)
    n_first: int  # mel frames of the first chunk
    n_next: int  # ... of the later ones
    ctx: int  # mel frames of left context per chunk
    mel_zero: float  # the pre-encode cache's starting value (silence)
    pre_cache: int  # mel frames of the pre-encode cache
    drop_extra: int  # pre-encoded frames a later chunk drops
    out_len: int  # encoder frames per chunk
    frame_ms: int  # one encoder frame
    nemo: bool  # NeMo's own framing

    @classmethod
    def of(cls, model, cfg: STTConfig) -> "Framing":
        """The framing of a cache-aware model set to ``cfg.att_context_size`` (its lookahead, where the
        model has another left context); NotImplementedError for a model this streaming cannot serve exactly."""
        enc, pp = model.encoder, model.preprocessor.featurizer
        enc.set_default_att_context_size(context_size(model, cfg))
        sc, hop = enc.streaming_cfg, int(pp.hop_length)
        if getattr(pp, "stft_pad_amount", None) is not None or int(pp.n_fft) // 2 >= hop * (CTX_FRAMES + 1):
            raise NotImplementedError("chunked features need a centred STFT with n_fft/2 < 3 hops")
        if str(model.cfg.preprocessor.get("normalize", "NA")).lower() not in ("na", "none"):
            raise NotImplementedError("cache-aware streaming needs un-normalised features (preprocessor.normalize: NA)")
        if not isinstance(sc.chunk_size, list) or not isinstance(sc.pre_encode_cache_size, list):
            raise NotImplementedError("expects a causal-downsampling cache-aware encoder (list-valued chunk sizes)")
        if getattr(model.joint, "num_extra_outputs", 0):
            raise NotImplementedError("TDT / multi-output joints are not supported by the greedy RNNT step")
        n_first, n_next = sc.chunk_size
        nemo, mel_zero = cfg.framing == "nemo", 0.0
        if nemo:
            from nemo.collections.asr.inference.utils.constants import LOG_MEL_ZERO

            n_first, mel_zero = n_next, float(LOG_MEL_ZERO)
        return cls(hop, int(pp.n_fft) // 2, n_first, n_next, 1 if nemo else CTX_FRAMES, mel_zero,
                   sc.pre_encode_cache_size[1], sc.drop_extra_pre_encoded, sc.valid_out_len,
                   enc.subsampling_factor * hop * 1000 // USER_RATE, nemo)

    def chunk_frames(self, st: SlotStream) -> int:
        return self.n_first if st.next_frame == 0 else self.n_next

    def has_chunk(self, st: SlotStream) -> bool:
        n = self.chunk_frames(st)
        if self.nemo:
            return st.total >= (st.next_frame + n) * self.hop
        return st.total >= (st.next_frame + n - 1) * self.hop + self.half_window

    def has_tail(self, st: SlotStream) -> bool:
        """Audio left for a last (short) chunk: at least one mel frame (NeMo's count is samples // hop)."""
        return st.total // self.hop > st.next_frame

    def segment(self, st: SlotStream, last: bool) -> tuple[np.ndarray, int]:
        """Raw audio of the stream's next chunk with its left context, consumed from the stream;
        and its frame count."""
        ctx = self.ctx * self.hop
        start = st.next_frame * self.hop - ctx
        if self.nemo:  # [chunk start - 1 hop, chunk end): NeMo's BatchedCacheFeatureBufferer
            end = min(st.total, (st.next_frame + self.n_next) * self.hop)
            n = min((end - st.next_frame * self.hop) // self.hop, self.n_next) if last else self.n_next
        elif last:
            n = st.total // self.hop - st.next_frame  # NeMo's valid frame count is samples // hop
            end = st.total
        else:
            n = self.chunk_frames(st)
            end = (st.next_frame + n - 1) * self.hop + self.half_window
        seg = st.buf[max(start, st.buf_start) - st.buf_start: end - st.buf_start]
        if start < st.buf_start:
            seg = np.concatenate([np.zeros(st.buf_start - start, np.float32), seg])
        # consume: keep audio from the next chunk's context start
        st.next_frame += n
        keep = max(st.next_frame * self.hop - ctx, 0)
        if keep > st.buf_start:
            st.buf = st.buf[keep - st.buf_start:]
            st.buf_start = keep
        return seg, n
