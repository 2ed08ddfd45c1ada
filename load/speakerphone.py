"""A client on a speakerphone: what it plays comes back into its microphone.

:class:`Speakerphone` plays received reply audio back to back from its arrival (a chunk that
arrives after the previous one ended starts when it arrives, as an underrun would), stops at an
interruption, and gives, for any stretch of microphone time, the echo of what was playing then:
``gain_db`` quieter and ``delay_s`` later (the room and the device's own buffering). A client
mixes :meth:`echo` into each microphone frame it sends, in real time.
"""
from __future__ import annotations

import numpy as np

from pipeline.audio import int16_to_float, resample
from pipeline.audio_constants import REPLY_RATE, USER_RATE


class Speakerphone:
    def __init__(self, t0: float, delay_s: float = 0.15, gain_db: float = -10.0, seconds: float = 600.0):
        self.t0 = t0  # wall time of microphone sample 0
        self.delay = int(delay_s * USER_RATE)
        self.gain = 10 ** (gain_db / 20)
        self._played = np.zeros(int(seconds * USER_RATE), np.float32)  # what plays, on the mic clock
        self._end = 0  # mic position after the last sample scheduled to play

    def _pos(self, t: float) -> int:
        return int(round((t - self.t0) * USER_RATE))

    def receive(self, pcm_24k: np.ndarray, at: float) -> None:
        """A reply chunk arrived at wall time ``at``: it plays after what is queued, not before now."""
        x = resample(int16_to_float(pcm_24k), REPLY_RATE, USER_RATE)
        start = max(self._end, self._pos(at))
        x = x[: max(0, len(self._played) - start)]
        self._played[start:start + len(x)] = x
        self._end = start + len(x)

    def flush(self, at: float) -> None:
        """Interrupted: nothing queued after ``at`` plays."""
        p = self._pos(at)
        if self._end > p:
            self._played[p:self._end] = 0
            self._end = p

    def echo(self, start: int, n: int) -> np.ndarray:
        """The echo in microphone samples [start, start + n), float in [-1, 1]."""
        lo, hi = max(0, start - self.delay), max(0, start + n - self.delay)
        out = np.zeros(n, np.float32)
        seg = self._played[lo:hi]
        out[n - len(seg):] = seg * self.gain
        return out
