"""How much of something a conversation accepts: at most ``rate`` units a second, sustained.

A token bucket: it starts full with ``burst`` units, refills at ``rate`` a second, and what it
cannot pay for is refused. Two of a conversation's inputs are bounded this way:

- microphone audio, in seconds of audio (``max_audio_rate`` x real time, ``audio_burst_s``): the ears
  (VAD, echo canceller) and the recogniser run on every frame a client sends, so a client pushing
  audio far faster than anyone speaks would buy itself a large share of the gateway's event loop
  and the STT replica. A whole turn may be sent at once, as a recorded clip is; an item of audio
  (the Realtime protocol's ``input_audio``) pays from the same bucket;
- replies asked for, typed turns and ``response.create`` alike (``max_replies_per_minute``,
  ``replies_burst``): each one runs the LLM, and a forced tool call builds its grammar.

The client is told once per episode of refusals: a new episode starts once the bucket has filled
back to half.
"""
from __future__ import annotations

from typing import Callable


class Allowance:
    def __init__(self, rate: float, burst: float, clock: Callable[[], float]):
        self.rate, self.burst, self.clock = rate, burst, clock
        self._credit = burst
        self._at = clock()
        self.told = False  # the client has been told of this episode of refusals

    def take(self, amount: float) -> bool:
        """Pay for ``amount``; False: over the allowance, refuse it."""
        now = self.clock()
        self._credit = min(self.burst, self._credit + (now - self._at) * self.rate)
        self._at = now
        if self._credit >= self.burst / 2:
            self.told = False
        if amount > self._credit:
            return False
        self._credit -= amount
        return True
