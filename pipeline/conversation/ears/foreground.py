"""The foreground talker: speech in the room behind the caller (a café's babble, a television) is
not the caller's speech, though Silero hears both as speech.

Measured on the noisy-speech bench (``python -m load.noisy``; docs/turn-taking.md, "Noise"): under
babble or a television's voice Silero stays in speech after the caller stops, so the turn never
ends. What tells them apart here is level: the caller is close to the microphone, the room is not.
:class:`Foreground` follows, per stream and per VAD window,

- the caller's level: the upper envelope of the windows heard as speech while the VAD is in
  speech (it rises 20 % of the way to a louder window and sinks 0.3 dB a second);
- the background's level: the lowest level over the last 5 s, of levels smoothed over ~3
  windows (minimum statistics);
- whether the background is voice: how often windows near its level are speech to Silero (an
  average over ~1.5 s). Near a steady noise's level they are not (pink, brown, a fan).

Only while the background is voice does it act: a window more than ``margin_db`` below the
caller's level and within ``BACKGROUND_DB`` of the background's is heard as silence. In quiet it
changes nothing (tests/test_noise.py). It does not act while a reply plays: there it decides
barge-ins, and with no caller heard yet a television would be taken for the caller, its quiet
stretches for silence and its every sentence for a new barge-in (47 a minute against 3 on the
bench); it is the end of the caller's turn that the room kept open.
"""
from __future__ import annotations

import numpy as np

BACKGROUND_DB = 10.0  # a window this close to the background's level is background
AT_BACKGROUND_DB = 8.0  # one this close is the background alone: whether it is voice is learnt from these
HISTORY = 156  # windows of levels kept for the background's minimum (5 s of 32 ms windows)
LEARNED = 10  # speech windows heard before the caller's level is trusted
RISE, SINK = 0.2, 0.01  # the caller's level: towards a louder window; dB per window down
VOICE_RATE = 0.02  # the background-is-voice average's weight per window near the background
VOICE = 0.5  # the background is voice at or above this share of speech windows


class Foreground:
    def __init__(self, margin_db: float):
        self.margin_db = margin_db
        self.caller_db: float | None = None  # the caller's level, dBFS
        self._heard = 0  # speech windows that taught it
        self._levels = np.zeros(HISTORY)  # smoothed window levels, a ring
        self._count = 0
        self._smooth = 0.0
        self.background_voice = 0.0  # share of windows near the background's level that are speech

    def judge(self, window: np.ndarray, p: float, threshold: float, speaking: bool, active: bool = True) -> float:
        """The speech probability of one window (float32 in [-1, 1]) as the VAD should take it: ``p``,
        or 0 for a background talker's window. Not ``active`` (a reply is playing): ``p``, and the
        caller's level learns nothing (their echo, or the room, is not the caller)."""
        level = 10 * np.log10(float(np.mean(window * window)) + 1e-10)
        self._smooth = level if self._count == 0 else 0.6 * self._smooth + 0.4 * level
        self._levels[self._count % HISTORY] = self._smooth
        self._count += 1
        background = float(np.min(self._levels[: self._count]))
        near_background = level < background + BACKGROUND_DB
        if level < background + AT_BACKGROUND_DB:
            self.background_voice += VOICE_RATE * ((p >= threshold) - self.background_voice)
        caller = self.caller_db
        if not active:
            return p
        if (caller is not None and self._heard >= LEARNED and self.background_voice >= VOICE
                and near_background and level < caller - self.margin_db):
            return 0.0
        if p >= threshold and speaking:
            self._heard += 1
            self.caller_db = level if caller is None else \
                caller + RISE * (level - caller) if level > caller else caller - SINK
        return p
