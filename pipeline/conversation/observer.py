"""What a conversation tells the metrics, as one observer (the gateway's counts Prometheus series:
``pipeline.metrics.MetricsObserver``; the call's record, ``call_record.py``, is another). The base
observes nothing; :class:`Observers` tells several."""
from __future__ import annotations


class Observer:
    def chunk_gap(self, seconds: float) -> None:
        """Time between two audio chunks of one reply."""

    def first_audio(self, seconds: float) -> None:
        """A reply's first audio, this long after the user's turn ended."""

    def voice_to_voice(self, seconds: float) -> None:
        """A reply's first audio, this long after the user's speech ended."""

    def stt_final(self, seconds: float) -> None:
        """A spoken turn's final transcript, this long after the user's speech ended."""

    def barge_in(self, seconds: float) -> None:
        """A playing reply's audio stopped, this long after the speech over it began."""

    def dead_air(self, seconds: float, cause: str) -> None:
        """A reply's audio ran out this long before its next chunk was sent (``cause``: the stage
        that was late, pipeline/conversation/dead_air.py)."""

    def turn_ended(self, by: str) -> None:
        """A user turn ended; ``by``: what ended it (turn_end, typed, smart_turn, silence, endpoint, max_turn, short: short speech over a paused reply)."""

    def interrupted(self) -> None:
        """A reply was cut (barge-in, a new turn, the client cancelled it)."""

    def error(self, code: str) -> None:
        """An error told to a client."""

    def smart_turn(self, seconds: float) -> None:
        """One Smart Turn call."""

    def speculation(self, outcome: str) -> None:
        """A preemptive LLM start's outcome: hit, miss or cancelled."""

    def phone_playback(self, provider: str, seconds: float) -> None:
        """A phone call's reply chunk played this long after it was sent (its mark's echo)."""

    def phone_gap(self, provider: str, seconds: float) -> None:
        """Dead air a caller heard before a reply chunk, measured by the marks."""


class Observers(Observer):
    """Several observers as one: each hears everything."""

    def __init__(self, *observers: Observer):
        self.observers = observers


def _fan_out(name: str):
    def each(self, *args) -> None:
        for observer in self.observers:
            getattr(observer, name)(*args)
    each.__name__ = name
    return each


for _name in [n for n, v in vars(Observer).items() if callable(v) and not n.startswith("_")]:
    setattr(Observers, _name, _fan_out(_name))
