"""The record of one call: per turn what was said and heard, when each stage answered, and every
stretch of dead air with the stage it came from (docs/observability.md, "The record of a call").

A :class:`CallRecord` is an :class:`~pipeline.conversation.observer.Observer` of its conversation
(the final transcript's latency, the end of each turn, barge-ins, errors) and sees every event the
conversation emits (the turns, the replies' ends). It keeps plain data only, bounded: the last
``MAX_TURNS`` turns (older ones are counted, not kept), ``MAX_REPLIES`` replies a turn, texts
clipped to ``MAX_TEXT`` characters, the first ``MAX_ERRORS`` errors. Nothing here does I/O: the
connection puts :meth:`CallRecord.as_dict` to the record store beside the conversation
(``pipeline/records/``).
"""
from __future__ import annotations

import time
from collections import deque
from typing import Callable

from pipeline.audio_constants import REPLY_RATE
from pipeline.conversation.events import ReplyDone, ToolCallAsked, TurnEnded
from pipeline.conversation.observer import Observer

MAX_TURNS = 200
MAX_REPLIES = 8
MAX_TEXT = 2000
MAX_ERRORS = 50
MARKS = ("llm_first_token_ms", "first_clause_ms", "tts_request_ms", "tts_first_chunk_ms", "first_audio_ms")


def _ms(seconds: float | None) -> int | None:
    return None if seconds is None else round(1000 * seconds)


def _clip(text: str) -> str:
    return text if len(text) <= MAX_TEXT else text[:MAX_TEXT] + "…"


class CallRecord(Observer):
    def __init__(self, session_id: str, clock: Callable[[], float]):
        self.session_id, self.clock = session_id, clock
        self.started_at, self._start = time.time(), clock()
        self.turns: deque[dict] = deque(maxlen=MAX_TURNS)
        self.turns_dropped = 0
        self.errors: list[dict] = []
        self.errors_dropped = 0
        self.version = 0  # moves on with every change (the keeper puts a record that changed)
        self._stt_final_s: float | None = None  # of the turn being concluded
        self._tools: dict[str, list[str]] = {}  # reply id -> the tools it called

    def _at(self) -> float:
        return round(self.clock() - self._start, 3)

    def _since_start(self, at: float | None) -> float | None:
        """A time of the session's clock as seconds since the record began (``started_at`` + it: the wall clock)."""
        return None if at is None else round(at - self._start, 4)

    def _changed(self) -> None:
        self.version += 1

    # ------------------------------------------------------------------ what the conversation observes
    def stt_final(self, seconds: float) -> None:
        self._stt_final_s = seconds

    def turn_ended(self, by: str) -> None:
        if self.turns:
            self.turns[-1]["ended_by"] = by

    def error(self, code: str) -> None:
        if len(self.errors) < MAX_ERRORS:
            self.errors.append({"at_s": self._at(), "code": code})
        else:
            self.errors_dropped += 1
        self._changed()

    # ------------------------------------------------------------------ what it emits
    def saw(self, event) -> None:
        """One event the conversation emitted."""
        if isinstance(event, TurnEnded):
            self._turn(event)
        elif isinstance(event, ToolCallAsked):
            self._tools.setdefault(event.reply.id, []).append(event.call.name)
        elif isinstance(event, ReplyDone):
            self._reply(event)

    def _turn(self, ev: TurnEnded) -> None:
        if len(self.turns) == self.turns.maxlen:
            self.turns_dropped += 1
        spoken = ev.item.audio
        self.turns.append({"turn": ev.turn, "at_s": self._at(), "user": _clip(ev.text), "spoken": spoken,
                           "ended_by": None, "stt_final_ms": _ms(self._stt_final_s) if spoken else None,
                           "replies": []})
        self._stt_final_s = None
        self._changed()

    def _reply(self, ev: ReplyDone) -> None:
        reply = ev.reply
        turn = next((t for t in reversed(self.turns) if t["turn"] == reply.turn), None)
        if turn is None:  # a greeting or a reply before any turn: a turn 0 of its own
            turn = {"turn": reply.turn, "at_s": self._at(), "user": None, "spoken": False, "ended_by": None,
                    "stt_final_ms": None, "replies": []}
            self.turns.append(turn)
        if len(turn["replies"]) >= MAX_REPLIES:
            return
        first_audio = reply.first_audio_at
        last = reply.messages[-1] if reply.messages else None  # what it answers (an item a client added, too)
        answers = last["content"] if isinstance(last, dict) and last.get("role") == "user" and \
            isinstance(last.get("content"), str) else None
        turn["replies"].append({
            "id": reply.id, "item_id": reply.item_id, "status": reply.status, "reason": reply.reason,
            "answers": None if answers is None else _clip(answers),
            "said": _clip(reply.text.strip()), "heard": _clip(ev.transcript),
            "audio_ms": round(1000 * reply.samples / REPLY_RATE),
            "turn_end_ms": _ms(reply.ended_at - reply.speech_end) if reply.speech_end is not None else None,
            "voice_to_voice_ms": _ms(first_audio - reply.speech_end)
            if first_audio is not None and reply.speech_end is not None else None,
            "speech_end_s": self._since_start(reply.speech_end),  # on the record's clock, for load/latency.py
            "first_audio_s": self._since_start(first_audio),
            "timings": {k: round(reply.marks[k]) for k in MARKS if k in reply.marks},
            "barge_in_ms": _ms(reply.barge_in_s),
            "tool_calls": self._tools.pop(reply.id, []),
            "gaps": [gap.as_dict() for gap in reply.air.gaps],
        })
        self._changed()

    def continue_from(self, earlier: dict) -> None:
        """A resumed session goes on with the record its dropped connection left (``as_dict``'s):
        its turns come first, and the times go on from its start."""
        turns = [t for t in earlier.get("turns", []) if isinstance(t, dict)]
        kept = list(self.turns)
        self.turns.clear()
        for turn in (turns + kept)[-MAX_TURNS:]:
            self.turns.append(turn)
        self.turns_dropped += int(earlier.get("turns_dropped", 0)) + max(0, len(turns) + len(kept) - MAX_TURNS)
        self.errors = (list(earlier.get("errors", [])) + self.errors)[:MAX_ERRORS]
        self.started_at = float(earlier.get("started_at", self.started_at))
        self._start -= float(earlier.get("duration_s", 0.0))
        self._changed()

    def as_dict(self) -> dict:
        return {"session_id": self.session_id, "started_at": self.started_at, "duration_s": self._at(),
                "turns": list(self.turns), "turns_dropped": self.turns_dropped, "errors": self.errors,
                "errors_dropped": self.errors_dropped}
