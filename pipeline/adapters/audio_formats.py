"""Audio as a wire protocol carries it, to and from what the engines take.

The recogniser hears int16 mono 16 kHz; the TTS speaks int16 mono 24 kHz. A client may send and
receive 16-bit PCM at 24 kHz (``audio/pcm``) or G.711 at 8 kHz (``audio/pcmu`` μ-law,
``audio/pcma`` A-law: telephony). An :class:`AudioFormat` names one of these;
:class:`Decoder` and :class:`Encoder` convert a stream of chunks, with soxr's streaming
resampler (its state carries across chunks, so chunk edges add no clicks) and the standard
library's G.711 codec (``audioop``; the ``audioop-lts`` package on Python 3.13+).
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass

import numpy as np
import soxr

from pipeline.audio_constants import REPLY_RATE, USER_RATE

with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)  # deprecated in 3.11-3.12, still the reference codec
    import audioop



@dataclass(frozen=True)
class AudioFormat:
    type: str  # "audio/pcm" | "audio/pcmu" | "audio/pcma"
    rate: int  # samples per second on the wire

    @property
    def bytes_per_sample(self) -> int:
        return 2 if self.type == "audio/pcm" else 1

    def describe(self) -> dict:
        return {"type": self.type, "rate": self.rate} if self.type == "audio/pcm" else {"type": self.type}


PCM_24K = AudioFormat("audio/pcm", 24_000)
PCMU = AudioFormat("audio/pcmu", 8_000)
PCMA = AudioFormat("audio/pcma", 8_000)
FORMATS = {f.type: f for f in (PCM_24K, PCMU, PCMA)}


def _to_linear(fmt: AudioFormat, data: bytes) -> np.ndarray:
    if fmt.type == "audio/pcmu":
        data = audioop.ulaw2lin(data, 2)
    elif fmt.type == "audio/pcma":
        data = audioop.alaw2lin(data, 2)
    elif len(data) % 2:
        raise ValueError(f"{fmt.type} audio must be an even number of bytes (int16), got {len(data)}")
    return np.frombuffer(data, dtype="<i2").astype(np.int16)


def _from_linear(fmt: AudioFormat, pcm: np.ndarray) -> bytes:
    data = np.ascontiguousarray(pcm, dtype="<i2").tobytes()
    if fmt.type == "audio/pcmu":
        return audioop.lin2ulaw(data, 2)
    if fmt.type == "audio/pcma":
        return audioop.lin2alaw(data, 2)
    return data


class _Resampler:
    """One direction of a stream: int16 chunks at ``src`` Hz -> int16 at ``dst`` Hz, with state."""

    def __init__(self, src: int, dst: int):
        self._stream = soxr.ResampleStream(src, dst, 1, dtype="int16") if src != dst else None

    def __call__(self, pcm: np.ndarray, last: bool = False) -> np.ndarray:
        if self._stream is None:
            return pcm
        return self._stream.resample_chunk(pcm, last=last)


class Decoder:
    """A client's audio in ``fmt`` -> int16 16 kHz for the engines, chunk by chunk."""

    def __init__(self, fmt: AudioFormat):
        self.format = fmt
        self._resample = _Resampler(fmt.rate, USER_RATE)

    def decode(self, data: bytes) -> np.ndarray:
        """Raises ValueError for bytes that are not whole samples of the format."""
        return self._resample(_to_linear(self.format, data))

    def flush(self) -> np.ndarray:
        """The resampler's last samples (the stream ends here: a committed turn); a new stream starts."""
        out = self._resample(np.zeros(0, np.int16), last=True)
        self._resample = _Resampler(self.format.rate, USER_RATE)
        return out


class Encoder:
    """Reply audio (int16 24 kHz) -> ``fmt`` bytes, chunk by chunk; one per reply."""

    def __init__(self, fmt: AudioFormat):
        self.format = fmt
        self._resample = _Resampler(REPLY_RATE, fmt.rate)

    def encode(self, pcm_24k: np.ndarray, last: bool = False) -> bytes:
        return _from_linear(self.format, self._resample(np.asarray(pcm_24k, np.int16), last=last))
