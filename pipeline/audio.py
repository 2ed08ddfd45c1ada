"""Audio helpers shared by engines, gateway and clients: int16 <-> float, resampling, WAV I/O."""
from __future__ import annotations

import io
import wave
from math import gcd
from typing import Iterator

import numpy as np
from scipy.signal import resample_poly  # imported here, not at first use: it takes ~1 s

from pipeline.audio_constants import USER_RATE


def pieces(pcm: np.ndarray, size: int = USER_RATE) -> Iterator[np.ndarray]:
    """``pcm`` in consecutive pieces of at most ``size`` samples: 1 s at the recogniser's rate, the
    most audio one ``Hear`` command (and one recogniser push) carries."""
    for start in range(0, len(pcm), size):
        yield pcm[start:start + size]


def int16_to_float(pcm: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(pcm, dtype=np.float32) / 32768.0


def float_to_int16(audio: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(np.clip(np.round(audio * 32767.0), -32768, 32767).astype(np.int16))


def resample(audio: np.ndarray, src_rate: int, dst_rate: int) -> np.ndarray:
    """Polyphase resampling (scipy's ``resample_poly``: Kaiser-windowed FIR, only the needed
    outputs computed), float32 in and out. 16 kHz -> 24 kHz is 3/2; 22.05 kHz -> 16 kHz 320/441."""
    if src_rate == dst_rate:
        return np.ascontiguousarray(audio, dtype=np.float32)
    g = gcd(src_rate, dst_rate)
    y = resample_poly(np.asarray(audio, dtype=np.float32), dst_rate // g, src_rate // g)
    return np.ascontiguousarray(y, dtype=np.float32)


def read_wav(path_or_bytes) -> tuple[np.ndarray, int]:
    """Read a mono/stereo 16-bit WAV; returns (int16 mono samples, sample rate)."""
    src = io.BytesIO(path_or_bytes) if isinstance(path_or_bytes, (bytes, bytearray)) else path_or_bytes
    with wave.open(src, "rb") as w:
        if w.getsampwidth() != 2:
            raise ValueError("only 16-bit PCM WAV files are supported")
        data = np.frombuffer(w.readframes(w.getnframes()), dtype="<i2")
        if w.getnchannels() > 1:
            data = data.reshape(-1, w.getnchannels()).mean(axis=1).astype(np.int16)
        return np.ascontiguousarray(data, dtype=np.int16), w.getframerate()


def write_wav(path, pcm: np.ndarray, rate: int) -> None:
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(np.ascontiguousarray(pcm, dtype="<i2").tobytes())


def speech_like(seconds: float, rate: int = USER_RATE, seed: int = 0) -> np.ndarray:
    """A deterministic speech-shaped test signal (voiced harmonics with syllable-rate envelope
    and pauses), int16. For load and protocol tests where the words do not matter."""
    rng = np.random.default_rng(seed)
    n = int(seconds * rate)
    t = np.arange(n) / rate
    f0 = 110 + 40 * rng.random() + 20 * np.sin(2 * np.pi * 0.7 * t)
    phase = 2 * np.pi * np.cumsum(f0) / rate
    voiced = sum((0.6 / k) * np.sin(k * phase) for k in range(1, 8))
    syllables = np.clip(np.sin(2 * np.pi * (3.5 + rng.random()) * t), 0, None) ** 2
    noise = 0.05 * rng.standard_normal(n)
    return float_to_int16(0.3 * voiced * syllables + noise * syllables)


def formant_speech(seconds: float, seed: int = 0) -> np.ndarray:
    """Deterministic synthetic 'speech', float32 at 16 kHz: voiced syllables (harmonics under
    formant-like peaks), some noise, pauses. The STT's calibration and test audio: it moves a
    random encoder more than ``speech_like`` does."""
    rng = np.random.default_rng(seed)
    n = int(seconds * USER_RATE)
    out = np.zeros(n, np.float32)
    pos = 0
    while pos < n:
        dur = int(rng.uniform(0.12, 0.3) * USER_RATE)
        seg = min(dur, n - pos)
        t = np.arange(seg) / USER_RATE
        f0 = rng.uniform(90, 220) * (1 + 0.1 * np.sin(2 * np.pi * rng.uniform(1, 4) * t))
        phase = 2 * np.pi * np.cumsum(f0) / USER_RATE
        formants = rng.uniform([300, 900, 2200], [900, 2200, 3200])
        sig = np.zeros(seg)
        for h in range(1, 30):
            fh = f0 * h
            amp = sum(np.exp(-(((fh - fm) / 150.0) ** 2)) for fm in formants) + 0.02
            sig += amp * np.sin(h * phase)
        sig += 0.3 * rng.standard_normal(seg) * (rng.random() < 0.3)  # fricative-ish
        env = np.sin(np.pi * np.arange(seg) / seg) ** 0.5
        out[pos : pos + seg] = (0.1 * sig * env).astype(np.float32)
        pos += seg + int(rng.uniform(0.0, 0.12) * USER_RATE)
    return np.clip(out, -1, 1)


class AudioRing:
    """The last ``capacity`` samples of a stream, kept without copying the stream per frame."""

    def __init__(self, capacity: int, dtype=np.int16):
        self._buf = np.zeros(capacity, dtype)
        self.written = 0  # samples appended so far

    def append(self, x: np.ndarray) -> None:
        cap = len(self._buf)
        x = np.asarray(x, self._buf.dtype)
        total = len(x)
        x = x[-cap:]  # of a frame longer than the ring, only its end is kept
        start = (self.written + total - len(x)) % cap
        first = min(len(x), cap - start)
        self._buf[start:start + first] = x[:first]
        self._buf[: len(x) - first] = x[first:]
        self.written += total

    def last(self, n: int) -> np.ndarray:
        """The last ``n`` samples (fewer if fewer were kept or written), oldest first."""
        n = max(0, min(n, self.written, len(self._buf)))
        end = self.written % len(self._buf)
        idx = (end - n + np.arange(n)) % len(self._buf)
        return self._buf[idx]
