"""Voice activity: Silero VAD (the real model from the ``silero-vad`` wheel) on a session's 16 kHz audio.

One :class:`SileroVAD` per process holds the ONNX model; each stream keeps its own recurrent
state and 64-sample context in a :class:`VoiceActivity`, which turns the per-window speech
probabilities into ``speech.started`` / ``speech.stopped`` events with hysteresis and minimum
durations. Positions are absolute sample indices of the stream, so a caller can cut its audio at
a speech onset. The model is fed exactly as ``silero_vad.OnnxWrapper`` feeds it (512-sample
windows after the previous window's last 64 samples); ``tests/test_turn_taking.py`` checks the
probabilities against that wrapper on the same audio.
"""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import numpy as np

from pipeline.audio_constants import USER_RATE
from pipeline.conversation.ears.foreground import Foreground
from pipeline.session_config import VADSettings

WINDOW = 512  # samples per model call at 16 kHz (32 ms)
CONTEXT = 64  # samples of the previous window the model sees before each window
STATE_SHAPE = (2, 1, 128)
# Silero's probability stays high for a window or two after the sound ends: on espeak-ng
# sentences the last speech window ended 17-88 ms after the last sound. A stop is placed this
# much before that window's end (then within ±40 ms of the sound's end on those sentences).
TRAIL = 768  # samples (48 ms)


def model_path() -> str:
    import silero_vad

    return os.path.join(os.path.dirname(silero_vad.__file__), "data", "silero_vad.onnx")


class SileroVAD:
    """The ONNX model, shared by every stream of a process (it holds no stream state).
    One call is ~0.09 ms on one CPU thread (docs/turn-taking.md)."""

    def __init__(self, path: str | None = None):
        import onnxruntime as ort

        opts = ort.SessionOptions()
        opts.intra_op_num_threads = 1
        opts.inter_op_num_threads = 1
        self._session = ort.InferenceSession(path or model_path(), sess_options=opts,
                                             providers=["CPUExecutionProvider"])
        self._sr = np.array(USER_RATE, dtype=np.int64)

    def __call__(self, window: np.ndarray, state: np.ndarray) -> tuple[float, np.ndarray]:
        """One window: float32 [CONTEXT + WINDOW] in [-1, 1] and the stream's state -> (p, new state)."""
        prob, state = self._session.run(None, {"input": window[None, :], "state": state, "sr": self._sr})
        return float(prob[0, 0]), state


@functools.cache
def shared_model() -> SileroVAD:
    return SileroVAD()


@dataclass(frozen=True)
class VADEvent:
    kind: str  # "speech.started" | "speech.stopped"
    sample: int  # stream position: the first speech window's start, or the first silent window's start


class VoiceActivity:
    """One stream's VAD: feed int16 audio in any frame sizes, get events in stream order."""

    def __init__(self, settings: VADSettings, model: SileroVAD | None = None):
        self.foreground: Foreground | None = None
        self.settings = settings
        self.model = model or shared_model()
        self._state = np.zeros(STATE_SHAPE, np.float32)
        self._buf = np.zeros(CONTEXT, np.float32)  # the context, then samples not yet in a window
        self.position = 0  # stream samples consumed into windows
        self.speaking = False  # between speech.started and speech.stopped
        self._run_start: int | None = None  # first window of the current speech run
        self._speech_end = 0  # end of the last speech window
        self._in_speech = False  # the last window was speech
        self.last_prob = 0.0

    @property
    def settings(self) -> VADSettings:
        return self._settings

    @settings.setter
    def settings(self, settings: VADSettings) -> None:
        self._settings = settings
        if settings.foreground_db <= 0:
            self.foreground = None
        elif self.foreground is None:
            self.foreground = Foreground(settings.foreground_db)
        else:
            self.foreground.margin_db = settings.foreground_db

    @property
    def speech_ms(self) -> float:
        """How long the current speech run has lasted (0 when there is none)."""
        if self._run_start is None:
            return 0.0
        return 1000 * (self._speech_end - self._run_start) / USER_RATE

    @property
    def silence_ms(self) -> float:
        """How long it has been silent since the speech ended (0 while speech goes on): counted
        from the end's estimate, ``TRAIL`` before the last speech window's end."""
        if self._in_speech or self._run_start is None and self._speech_end == 0:
            return 0.0
        return 1000 * (self.position - self._speech_end + TRAIL) / USER_RATE

    def push(self, pcm: np.ndarray, foreground: bool = True) -> list[VADEvent]:
        """``foreground``: the foreground rule may act (no reply is playing)."""
        self._buf = np.concatenate([self._buf, np.asarray(pcm, np.float32) / 32768.0])
        events: list[VADEvent] = []
        while len(self._buf) >= CONTEXT + WINDOW:
            window = self._buf[: CONTEXT + WINDOW]
            self.last_prob, self._state = self.model(window, self._state)
            if self.foreground is not None:
                self.last_prob = self.foreground.judge(window[CONTEXT:], self.last_prob, self.settings.threshold,
                                                       self.speaking, foreground)
            self._buf = self._buf[WINDOW:]
            start = self.position
            self.position += WINDOW
            ev = self._step(self.last_prob, start)
            if ev is not None:
                events.append(ev)
        return events

    def _step(self, p: float, start: int) -> VADEvent | None:
        """Speech starts after ``min_speech_ms`` of windows at or above the threshold, and stops
        once a window below ``off_threshold`` comes ``min_silence_ms`` after the last speech
        window; the stop's position is that window's end (Silero's probability trails the sound
        by a window or two: the stop is placed ``TRAIL`` before the end of the last speech window)."""
        s = self.settings
        self._in_speech = p >= s.threshold
        if self._in_speech:
            self._speech_end = self.position
            if self._run_start is None:
                self._run_start = start
            if not self.speaking and self.speech_ms >= s.min_speech_ms:
                self.speaking = True
                return VADEvent("speech.started", self._run_start)
            return None
        if p >= s.off_threshold:
            return None  # between the thresholds: neither more speech nor the end of it
        if not self.speaking:
            self._run_start = None  # a blip shorter than min_speech_ms is not speech
            return None
        if self.silence_ms >= s.min_silence_ms:
            self.speaking = False
            at, self._run_start = self._run_start, None
            return VADEvent("speech.stopped", max(at, self._speech_end - TRAIL))
        return None
