"""Spoken test audio from espeak-ng (16 kHz int16), with the speech boundaries known exactly.

espeak-ng pads its output with silence of its own; :func:`espeak` trims it to the first and
last sample above a noise floor, so a clip built by :func:`padded` or :func:`with_pauses` knows
where its speech starts and ends (the reference the turn-taking tests and tools measure from).

A machine without espeak-ng (the air-gapped GPU machine) speaks from clips rendered elsewhere:
``python -m load.speech render DIR`` writes every clip the load tools say, and ``$GAPLESS_SPEECH_DIR``
(DIR) is read before espeak-ng is asked (and written when espeak-ng speaks a clip it lacks).
"""
from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

from pipeline.audio import float_to_int16, int16_to_float, read_wav, resample, write_wav
from pipeline.audio_constants import USER_RATE

FLOOR = 0.01  # of full scale: a sample above it is sound, not silence


CLIPS_ENV = "GAPLESS_SPEECH_DIR"


def available() -> bool:
    return shutil.which("espeak-ng") is not None


def _clip_path(text: str, speed: int) -> Path | None:
    root = os.environ.get(CLIPS_ENV)
    key = hashlib.sha256(f"{speed}\n{text}".encode()).hexdigest()[:20]
    return Path(root) / f"{key}.wav" if root else None


def can_say(text: str, speed: int = 160) -> bool:
    clip = _clip_path(text, speed)
    return available() or (clip is not None and clip.exists())


def spoken(text: str, speed: int = 160) -> tuple[np.ndarray, int]:
    """espeak-ng's output for ``text`` as it wrote it (int16, its own rate and padding): from
    ``$GAPLESS_SPEECH_DIR`` when the clip is there, else from espeak-ng (kept there when set)."""
    clip = _clip_path(text, speed)
    if clip is not None and clip.exists():
        return read_wav(str(clip))
    if not available():
        raise RuntimeError(f"espeak-ng is not installed and {CLIPS_ENV} holds no clip of {text!r} "
                           f"(render them where espeak-ng is: python -m load.speech render DIR)")
    with tempfile.TemporaryDirectory() as tmp:
        wav = Path(tmp) / "speech.wav"
        subprocess.run(["espeak-ng", "-s", str(speed), "-w", str(wav), text], check=True, capture_output=True)
        pcm, rate = read_wav(str(wav))
    if clip is not None:
        clip.parent.mkdir(parents=True, exist_ok=True)
        write_wav(str(clip), pcm, rate)
    return pcm, rate


def espeak(text: str, speed: int = 160) -> np.ndarray:
    """``text`` spoken by espeak-ng, 16 kHz int16, trimmed to its sound."""
    pcm, rate = spoken(text, speed)
    pcm = float_to_int16(resample(int16_to_float(pcm), rate, USER_RATE))
    first, last = sound_bounds(pcm)
    return pcm[first:last]


def sound_bounds(pcm: np.ndarray) -> tuple[int, int]:
    """(first sample above the noise floor, one past the last one); (0, 0) for silence."""
    loud = np.flatnonzero(np.abs(pcm.astype(np.int32)) > FLOOR * 32768)
    return (int(loud[0]), int(loud[-1]) + 1) if len(loud) else (0, 0)


def silence(seconds: float) -> np.ndarray:
    return np.zeros(int(seconds * USER_RATE), np.int16)


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


# What the load tools say: load.gaps, load.concurrency and load.cost speak SPOKEN; load.turn_taking
# the SENTENCES, the PAUSED one (its parts and the pause between them) and the PERSON's cut-in.
SPOKEN = [
    "Hi there.",
    "Can you hear me clearly?",
    "I would like to know how streaming speech recognition works.",
    "Goodbye for now.",
    "Let us talk about the history of the printing press and its effect on Europe.",
    "Yes.",
    "What is the capital of France?",
    "Tell me something interesting about octopuses and their eight arms.",
]
SENTENCES = ["Please turn off the lights in the kitchen.", "What is the weather like in London today?",
             "Tell me a joke about cats.", "I would like to book a flight to Paris on Friday."]
PAUSED = (["I would like to book a flight to", "Paris on Friday."], 0.5)
PERSON = "Stop, wait a moment please."


def render(root: str) -> int:
    """Every clip the load tools say (load.gaps, load.concurrency, load.cost, load.turn_taking) into
    ``root``, for a machine without espeak-ng. Returns the number of clips."""
    os.environ[CLIPS_ENV] = root
    texts = [*SPOKEN, *SENTENCES, *PAUSED[0], PERSON]
    for text in texts:
        spoken(text)
    return len(texts)


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] != "render":
        sys.exit("usage: python -m load.speech render DIR")
    print(f"{render(sys.argv[2])} clips in {sys.argv[2]}")
