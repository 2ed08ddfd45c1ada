"""Audio as a wire protocol carries it, to and from what the engines take.

The recogniser hears int16 mono 16 kHz; the TTS speaks int16 mono 24 kHz. A client may send and
receive 16-bit PCM at 24 kHz (``audio/pcm``) or G.711 at 8 kHz (``audio/pcmu`` μ-law,
``audio/pcma`` A-law: telephony). An :class:`AudioFormat` names one of these;
:class:`Decoder` and :class:`Encoder` convert a stream of chunks, with FFmpeg's resampler
(PyAV's ``AudioResampler``: its state carries across chunks, so chunk edges add no clicks, and it
holds back only its filter's few samples, 1 to 2 ms) and the standard library's G.711
codec (``audioop``; the ``audioop-lts`` package on Python 3.13+). soxr's streaming resampler, used
before, emits in blocks: fed a phone's 20 ms frames it held 63 ms of the caller's audio on
average (115 ms at most) from 8 to 16 kHz, and 22 ms from 24 to 16 kHz, before the VAD heard it.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass

import fractions

import numpy as np
from av import AudioFrame, AudioResampler

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
    """One direction of a stream: int16 chunks at ``src`` Hz -> int16 at ``dst`` Hz, with state;
    ``last`` flushes the filter's held samples (the stream ends there)."""

    def __init__(self, src: int, dst: int):
        self.src, self.dst = src, dst
        self._swr = AudioResampler(format="s16", layout="mono", rate=dst) if src != dst else None
        self._pts = 0

    def __call__(self, pcm: np.ndarray, last: bool = False) -> np.ndarray:
        if self._swr is None:
            return pcm
        frames = []
        if len(pcm):
            frame = AudioFrame.from_ndarray(np.ascontiguousarray(pcm, np.int16).reshape(1, -1), format="s16",
                                            layout="mono")
            frame.sample_rate, frame.pts, frame.time_base = self.src, self._pts, fractions.Fraction(1, self.src)
            self._pts += len(pcm)
            frames += self._swr.resample(frame)
        if last:  # flushed, FFmpeg's resampler takes no more: a new stream starts with a new one
            frames += self._swr.resample(None)
            self._swr, self._pts = AudioResampler(format="s16", layout="mono", rate=self.dst), 0
        return np.concatenate([f.to_ndarray().reshape(-1) for f in frames]) if frames else np.zeros(0, np.int16)


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
