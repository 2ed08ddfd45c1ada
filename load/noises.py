"""Noise for the noisy-speech bench (``load/noisy.py``), made in code from a seed: no recordings.

Each kind is 16 kHz float32 in [-1, 1], any length, with its RMS (over its sounding parts, for
bursts) at 1.0 before :func:`at_snr` scales it under a clip of speech:

- ``babble``: six espeak-ng voices, different sentences, speeds and pitches, overlapped (a café);
- ``pink`` and ``brown``: 1/f and 1/f² noise (fans, traffic, a car at speed);
- ``tv``: one espeak-ng voice over music-like chords of decaying tones (a television);
- ``bursts``: a door (a low thump), a cough (a band of noise, twice), keyboard clicks, one
  every 1-2 s with quiet between.
"""
from __future__ import annotations

import numpy as np
from scipy.signal import butter, sosfilt

from load import speech
from pipeline.audio import int16_to_float
from pipeline.audio_constants import USER_RATE

KINDS = ("babble", "pink", "brown", "tv", "bursts")
BABBLE = ["The meeting moved to Thursday afternoon.", "Did you see the game last night?",
          "I will have the soup and a glass of water.", "She said the train was late again.",
          "We should paint the kitchen yellow.", "Two coffees and a croissant, please."]
SOUNDING = 0.05  # of a burst's peak: the part of it counted in its RMS


def _rms(x: np.ndarray, sounding: bool = False) -> float:
    if sounding:
        x = x[np.abs(x) >= SOUNDING * np.max(np.abs(x))]
    return float(np.sqrt(np.mean(np.square(x, dtype=np.float64)))) if len(x) else 0.0


def _unit(x: np.ndarray, sounding: bool = False) -> np.ndarray:
    return (x / max(_rms(x, sounding), 1e-9)).astype(np.float32)


def _tiled(x: np.ndarray, n: int, rng: np.random.Generator) -> np.ndarray:
    """``x`` repeated from a random offset to ``n`` samples."""
    reps = -(-n // len(x)) + 1
    start = int(rng.integers(len(x)))
    return np.tile(x, reps)[start:start + n]


def _coloured(n: int, exponent: float, rng: np.random.Generator) -> np.ndarray:
    """Gaussian noise with power ∝ 1/f**exponent (above 20 Hz)."""
    spectrum = np.fft.rfft(rng.standard_normal(n))
    f = np.fft.rfftfreq(n, 1 / USER_RATE)
    spectrum *= 1 / np.maximum(f, 20.0) ** (exponent / 2)
    return np.fft.irfft(spectrum, n)


def _voice(text: str, speed: int) -> np.ndarray:
    return int16_to_float(speech.espeak(text, speed))


def _babble(n: int, rng: np.random.Generator) -> np.ndarray:
    out = np.zeros(n, np.float64)
    for i, text in enumerate(BABBLE):
        voice = _voice(text, speed=140 + 15 * i)
        out += _unit(_tiled(np.concatenate([voice, np.zeros(int(rng.integers(2000, 8000)))]), n, rng))
    return out


def _chords(n: int, rng: np.random.Generator) -> np.ndarray:
    """Music-like: a chord of three tones with harmonics every 0.5 s, each decaying."""
    out, t, beat = np.zeros(n), np.arange(USER_RATE // 2) / USER_RATE, USER_RATE // 2
    for at in range(0, n, beat):
        root = 110 * 2 ** (int(rng.integers(0, 24)) / 12)
        note = sum(np.sin(2 * np.pi * root * r * h * t) / h for r in (1, 1.26, 1.5) for h in (1, 2, 3))
        seg = note * np.exp(-4 * t)
        out[at:at + beat] = seg[: n - at]
    return out


def _bursts(n: int, rng: np.random.Generator) -> np.ndarray:
    out, at = np.zeros(n), int(rng.integers(USER_RATE // 2, USER_RATE))
    low = butter(4, 150, "lowpass", fs=USER_RATE, output="sos")
    band = butter(4, [300, 2500], "bandpass", fs=USER_RATE, output="sos")
    while at < n:
        kind = int(rng.integers(3))
        if kind == 0:  # a door: a thump of low noise and a 70 Hz ring, 250 ms
            t = np.arange(USER_RATE // 4) / USER_RATE
            ev = (sosfilt(low, rng.standard_normal(len(t))) * 4 + np.sin(2 * np.pi * 70 * t)) * np.exp(-18 * t)
        elif kind == 1:  # a cough: two bursts of band noise, 180 ms each, 120 ms apart
            t = np.arange(int(0.18 * USER_RATE)) / USER_RATE
            one = sosfilt(band, rng.standard_normal(len(t))) * np.sin(np.pi * t / t[-1]) ** 0.5 * np.exp(-6 * t)
            ev = np.concatenate([one, np.zeros(int(0.12 * USER_RATE)), 0.7 * one])
        else:  # keyboard: 12 clicks of 4 ms over a second
            ev = np.zeros(USER_RATE)
            for k in np.sort(rng.integers(0, USER_RATE - 64, 12)):
                ev[k:k + 64] += rng.standard_normal(64) * np.exp(-np.arange(64) / 10)
        out[at:at + len(ev)] += ev[: n - at]
        at += len(ev) + int(rng.integers(USER_RATE, 2 * USER_RATE))
    return out


def noise(kind: str, seconds: float, seed: int) -> np.ndarray:
    """``seconds`` of ``kind`` at RMS 1 (bursts: over their sounding parts)."""
    rng, n = np.random.default_rng(seed), int(seconds * USER_RATE)
    if kind == "babble":
        return _unit(_babble(n, rng))
    if kind == "pink":
        return _unit(_coloured(n, 1.0, rng))
    if kind == "brown":
        return _unit(_coloured(n, 2.0, rng))
    if kind == "tv":
        voice = _voice("Tonight on the news, the weather turns cold and the roads are busy. More after the break.", 170)
        return _unit(_unit(_tiled(voice, n, rng)) + 0.7 * _unit(_chords(n, rng)))
    if kind == "bursts":
        return _unit(_bursts(n, rng), sounding=True)
    raise ValueError(f"unknown noise {kind!r}; one of {', '.join(KINDS)}")


def at_snr(noise_unit: np.ndarray, speech_rms: float, snr_db: float) -> np.ndarray:
    """The noise scaled to ``snr_db`` under speech of RMS ``speech_rms`` (float, full scale 1)."""
    return noise_unit * (speech_rms / 10 ** (snr_db / 20))


def speech_rms(pcm: np.ndarray) -> float:
    """A clip's speech level: the RMS of its sounding samples (float, full scale 1)."""
    x = int16_to_float(pcm)
    return _rms(x[np.abs(x) >= speech.FLOOR])
