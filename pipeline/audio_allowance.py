"""How much microphone audio a conversation accepts: at most ``rate`` times real time, sustained.

The ears (VAD, echo canceller) and the recogniser run on every frame a client sends, so a client
pushing audio far faster than anyone speaks would buy itself a large share of the gateway's event
loop and the STT replica. A token bucket of audio seconds: it starts full with ``burst_s`` (a whole
turn may be sent at once, as a recorded clip is), refills at ``rate`` seconds of audio per second,
and a frame it cannot pay for is dropped. The client is told once per episode of dropped frames:
a new episode starts once the bucket has filled back to half.
"""
from __future__ import annotations

from typing import Callable


class AudioAllowance:
    def __init__(self, rate: float, burst_s: float, clock: Callable[[], float]):
        self.rate, self.burst_s, self.clock = rate, burst_s, clock
        self._credit_s = burst_s
        self._at = clock()
        self.told = False  # the client has been told of this episode of dropped frames

    def take(self, seconds: float) -> bool:
        """Pay for a frame of ``seconds`` of audio; False: over the allowance, drop it."""
        now = self.clock()
        self._credit_s = min(self.burst_s, self._credit_s + (now - self._at) * self.rate)
        self._at = now
        if self._credit_s >= self.burst_s / 2:
            self.told = False
        if seconds > self._credit_s:
            return False
        self._credit_s -= seconds
        return True
