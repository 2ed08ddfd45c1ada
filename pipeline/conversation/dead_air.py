"""Dead air inside a reply, and the stage it came from.

A reply's audio is sent paced a little ahead of real time, so the client plays it without a break
while every next chunk is sent before the audio already sent runs out. When one is not, the
caller hears silence: dead air, from the moment the sent audio ran out to the moment the next
chunk was sent. A :class:`Stages` clock keeps, for one reply, what each of its two tasks was
waiting on and when (the synthesis: the LLM's next clause, or the TTS; the sender: the client's
socket taking a chunk), and names the stage that held up most of a gap (:meth:`Stages.blame`).

Bounded: a reply keeps its last ``MAX_SPANS`` spans and its first ``MAX_GAPS`` gaps.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Callable

DEAD_AIR_MIN_S = 0.15  # shorter breaks go unnoticed (and are within a client's jitter buffer)
MAX_SPANS = 64
MAX_GAPS = 32

# The causes (``voice_dead_air_seconds{cause}``, the call record's gaps).
LLM, TTS, CLIENT, ENGINE_UNAVAILABLE = "llm", "tts", "client", "engine_unavailable"


@dataclass(frozen=True)
class Gap:
    """Dead air a caller heard: ``at_ms`` into the reply's audio, ``ms`` long, because of ``cause``."""

    at_ms: float
    ms: float
    cause: str

    def as_dict(self) -> dict:
        return {"at_ms": round(self.at_ms), "ms": round(self.ms), "cause": self.cause}


class Stages:
    """What a reply's synthesis and sender were waiting on, as time spans on ``clock``."""

    def __init__(self, clock: Callable[[], float]):
        self.clock = clock
        self._spans: deque[tuple[str, float, float]] = deque(maxlen=MAX_SPANS)  # (stage, from, to), ended
        self._open: dict[str, tuple[str, float]] = {}  # task -> (stage, since)

    def wait(self, task: str, stage: str) -> None:
        """``task`` ("synthesis" or "sender") waits on ``stage`` from now (ending what it waited on before)."""
        self.done(task)
        self._open[task] = (stage, self.clock())

    def done(self, task: str) -> None:
        """``task`` waits on nothing from now."""
        if task in self._open:
            stage, since = self._open.pop(task)
            self._spans.append((stage, since, self.clock()))

    def blame(self, start: float, end: float) -> str:
        """The stage whose waits cover most of ``start``..``end``: the client where the sender was
        held by its socket, else what the synthesis waited on (the LLM's text or the TTS)."""
        now = self.clock()
        spans = list(self._spans) + [(stage, since, now) for stage, since in self._open.values()]
        share: dict[str, float] = {}
        for stage, a, b in spans:
            overlap = min(b, end) - max(a, start)
            if overlap > 0:
                share[stage] = share.get(stage, 0.0) + overlap
        return max(share, key=share.get) if share else TTS


class DeadAir:
    """One reply's dead air: each gap is kept (bounded) and told to ``observe(seconds, cause)``."""

    def __init__(self, clock: Callable[[], float], observe: Callable[[float, str], None]):
        self.stages = Stages(clock)
        self.observe = observe
        self.gaps: list[Gap] = []

    def check(self, ran_out_at: float, now: float, at_ms: float, cause: str | None = None) -> float:
        """The sent audio ran out at ``ran_out_at`` (``at_ms`` into the reply) and its next audio
        leaves (or its end is known) at ``now``: a gap if the silence was long enough, blamed on
        ``cause`` or on the stage that held it up. Returns the silence (0: none), by which the
        client's playback now runs late."""
        silent = max(0.0, now - ran_out_at)
        if silent < DEAD_AIR_MIN_S:
            return silent
        cause = cause or self.stages.blame(ran_out_at, now)
        self.observe(silent, cause)
        if len(self.gaps) < MAX_GAPS:
            self.gaps.append(Gap(at_ms, 1000 * silent, cause))
        return silent
