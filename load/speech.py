"""Spoken test audio from espeak-ng (16 kHz int16), with the speech boundaries known exactly.

espeak-ng pads its output with silence of its own; :func:`espeak` trims it to the first and
last sample above a noise floor, so a clip built by :func:`padded` or :func:`with_pauses` knows
where its speech starts and ends (the reference the turn-taking tests and tools measure from).
"""
from __future__ import annotations

import shutil
import subprocess
import tempfile
from pathlib import Path

import numpy as np

from pipeline.audio import float_to_int16, int16_to_float, read_wav, resample

RATE = 16_000
FLOOR = 0.01  # of full scale: a sample above it is sound, not silence


def available() -> bool:
    return shutil.which("espeak-ng") is not None


def espeak(text: str, speed: int = 160) -> np.ndarray:
    """``text`` spoken by espeak-ng, 16 kHz int16, trimmed to its sound."""
    with tempfile.TemporaryDirectory() as tmp:
        wav = Path(tmp) / "speech.wav"
        subprocess.run(["espeak-ng", "-s", str(speed), "-w", str(wav), text], check=True, capture_output=True)
        pcm, rate = read_wav(str(wav))
    pcm = float_to_int16(resample(int16_to_float(pcm), rate, RATE))
    first, last = sound_bounds(pcm)
    return pcm[first:last]


def sound_bounds(pcm: np.ndarray) -> tuple[int, int]:
    """(first sample above the noise floor, one past the last one); (0, 0) for silence."""
    loud = np.flatnonzero(np.abs(pcm.astype(np.int32)) > FLOOR * 32768)
    return (int(loud[0]), int(loud[-1]) + 1) if len(loud) else (0, 0)


def silence(seconds: float) -> np.ndarray:
    return np.zeros(int(seconds * RATE), np.int16)


def padded(pcm: np.ndarray, before_s: float, after_s: float) -> np.ndarray:
    return np.concatenate([silence(before_s), pcm, silence(after_s)])


def with_pauses(parts: list[str], pause_s: float, speed: int = 160) -> np.ndarray:
    """The parts spoken one after another with ``pause_s`` of silence between them."""
    out: list[np.ndarray] = []
    for i, text in enumerate(parts):
        if i:
            out.append(silence(pause_s))
        out.append(espeak(text, speed))
    return np.concatenate(out)
