"""What a conversation tells the metrics, as one observer (the gateway's counts Prometheus series:
``pipeline.metrics.MetricsObserver``). The base observes nothing."""
from __future__ import annotations


class Observer:
    def chunk_gap(self, seconds: float) -> None:
        """Time between two audio chunks of one reply."""

    def first_audio(self, seconds: float) -> None:
        """A reply's first audio, this long after the user's turn ended."""

    def turn_ended(self, by: str) -> None:
        """A user turn ended; ``by``: what ended it (turn_end, typed, smart_turn, silence, endpoint, max_turn)."""

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
