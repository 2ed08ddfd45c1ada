"""Mimi encode of audio clips (a user's turn, a voice's reference clip) in fixed shapes only.

Up to the largest bucket a clip is padded at the end to the next bucket and encoded in one call
(Mimi is causal, so the valid frames' codes equal an unpadded encode). Longer: Mimi's streaming
encode over pieces of exactly the largest bucket (the last one padded), whose codes equal a
one-shot encode of the whole. Either way only warmed shapes run (docs/stall.md).
"""
from __future__ import annotations

from contextlib import ExitStack
from typing import Callable, Iterator

import numpy as np
import torch

from pipeline.audio_constants import CODEC_FRAME_SAMPLES, REPLY_RATE, USER_RATE
from pipeline.tts.mimi import encode_streaming_modules


def mimi_encode(mimi, wav: torch.Tensor) -> torch.Tensor:
    return mimi.encode(wav)


def mimi_encode_piece(mimi, wav: torch.Tensor) -> torch.Tensor:
    """One piece of a streaming encode (the encode path's modules are in streaming mode)."""
    emb = mimi.encoder(wav)
    if mimi.encoder_transformer is not None:
        (emb,) = mimi.encoder_transformer(emb)
    return mimi.quantizer.encode(mimi._to_framerate(emb))


class ClipEncoder:
    """``encode`` and ``encode_piece``: the gated (warmed, possibly compiled) forms of
    :func:`mimi_encode` and :func:`mimi_encode_piece`."""

    def __init__(self, mimi, encode: Callable, encode_piece: Callable, buckets: tuple[int, ...], num_codebooks: int,
                 device: torch.device):
        self.mimi, self.encode_fn, self.piece_fn = mimi, encode, encode_piece
        self.buckets, self.num_codebooks, self.device = buckets, num_codebooks, device

    def encode_wave(self, wav: np.ndarray) -> np.ndarray:
        """Float mono 24 kHz audio -> Mimi codes [T, 32] int64, T = ceil(len / 1920)."""
        for codes in self._pieces(wav):
            pass
        return codes

    @torch.inference_mode()
    def _pieces(self, wav: np.ndarray) -> Iterator[np.ndarray | None]:
        """:meth:`encode_wave` one call of the encoder at a time: None after each piece but the
        last, then the codes. The encoder's streaming state lives from the first piece to the last."""
        wav = np.asarray(wav, dtype=np.float32).reshape(-1)
        n = len(wav)
        if n == 0:
            yield np.zeros((0, self.num_codebooks), dtype=np.int64)
            return
        frames = -(-n // CODEC_FRAME_SAMPLES)
        top = self.buckets[-1]
        if frames <= top:
            b = next(b for b in self.buckets if frames <= b)
            x = np.zeros(b * CODEC_FRAME_SAMPLES, dtype=np.float32)
            x[:n] = wav
            codes = self.encode_fn(torch.from_numpy(x).to(self.device).view(1, 1, -1))[0, :, :frames]
        else:
            piece = top * CODEC_FRAME_SAMPLES
            x = np.zeros(-(-n // piece) * piece, dtype=np.float32)
            x[:n] = wav
            xt = torch.from_numpy(x).to(self.device).view(1, 1, -1)
            parts = []
            with ExitStack() as stack:
                for m in encode_streaming_modules(self.mimi):
                    stack.enter_context(m.streaming(1))
                for a in range(0, len(x), piece):
                    if parts:
                        yield None
                    parts.append(self.piece_fn(xt[..., a: a + piece]))
            codes = torch.cat(parts, dim=-1)[0, :, :frames]
        yield codes.T.cpu().numpy().astype(np.int64)

    def audio_pieces(self, pcm: np.ndarray, rate: int) -> Iterator[np.ndarray | None]:
        """:meth:`encode_audio` a piece per ``next()``: None until the last piece, which gives the
        codes. Run each ``next()`` on the inference thread, and other work there between them (the
        batched frame step: one long clip encoded in one call held every stream for its whole
        length); one such encode at a time, since the encoder's streaming state is one."""
        from pipeline.audio import int16_to_float, resample

        yield None  # nothing done before the first next(): the resampling runs there too
        yield from self._pieces(resample(int16_to_float(np.asarray(pcm, dtype=np.int16)), rate, REPLY_RATE))

    def encode(self, pcm_24k: np.ndarray) -> np.ndarray:
        """Audio (int16 or float in [-1, 1], mono 24 kHz) -> Mimi codes [T, 32] int64."""
        x = np.asarray(pcm_24k)
        x = x.astype(np.float32) / 32768.0 if x.dtype == np.int16 else x.astype(np.float32)
        return self.encode_wave(x)

    def encode_audio(self, pcm: np.ndarray, rate: int) -> np.ndarray:
        """int16 mono audio at ``rate`` -> Mimi codes [T, 32]: resampled to 24 kHz once, then
        :meth:`encode_wave`. Encode each user turn once and keep its codes in its Segment."""
        from pipeline.audio import int16_to_float, resample

        return self.encode_wave(resample(int16_to_float(np.asarray(pcm, dtype=np.int16)), rate, REPLY_RATE))

    def encode_user_audio(self, pcm_16k: np.ndarray) -> np.ndarray:
        """A user turn as the gateway carries it (int16 mono 16 kHz) -> Mimi codes [T, 32] int64."""
        return self.encode_audio(pcm_16k, USER_RATE)
