"""What the carrier holds of a reply and the caller's phone has not played yet.

A carrier cannot pause its playback: ``clear`` drops what it holds. So a reply paused by speech
that may be no turn (``resume_false_interruption``) is cleared at the carrier, and what the caller
had not heard of it is kept here and sent again, first, when it resumes: nothing skipped. Each
chunk's audio is kept until its mark comes back (the phone played it); the chunk playing when the
reply paused is cut where the phone had got to, counted from when it began to play (its
predecessor's echo, or its own sending if the carrier was idle). An echo comes back a network
trip after the audio before it played, so about that much (tens of ms) may be said twice; where
it cannot be told (another reply's audio before it, chunks forgotten), the chunk is sent whole.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from pipeline.audio_constants import REPLY_RATE

MAX_UNPLAYED_S = 10.0  # the most reply audio kept (a carrier that never echoes a mark forgets the oldest)


@dataclass(frozen=True)
class Held:
    """A paused reply's audio the caller has not heard: ``pcm`` (24 kHz), from ``audio_ms`` into its item."""

    item_id: str
    audio_ms: float
    pcm: np.ndarray


class Unplayed:
    """The chunks of the reply being sent whose marks have not come back, in order."""

    def __init__(self):
        self._chunks: OrderedDict[str, tuple[str, float, np.ndarray, float]] = OrderedDict()  # name -> (item, start ms, pcm, sent at)
        self._samples = 0
        self._echoed_at: float | None = None  # when the last mark came back
        self._evicted = False  # chunks were forgotten unechoed (over MAX_UNPLAYED_S)

    def sent(self, name: str, item_id: str, start_ms: float, pcm: np.ndarray, now: float) -> None:
        self._chunks[name] = (item_id, start_ms, np.asarray(pcm, np.int16), now)
        self._samples += len(pcm)
        while self._samples > MAX_UNPLAYED_S * REPLY_RATE:
            self._samples -= len(self._chunks.popitem(last=False)[1][2])
            self._evicted = True

    def echoed(self, name: str, now: float) -> None:
        """Mark ``name`` came back: its chunk and those before it have played."""
        if name not in self._chunks:
            return
        while self._chunks:
            first, (_, _, pcm, _) = self._chunks.popitem(last=False)
            self._samples -= len(pcm)
            if first == name:
                break
        self._echoed_at = now
        self._evicted = self._evicted and bool(self._chunks)

    def forget(self) -> None:
        """The reply ended (or was cut): nothing of it is sent again."""
        self._chunks.clear()
        self._samples, self._echoed_at, self._evicted = 0, None, False

    def hold(self, item_id: str, now: float) -> Held | None:
        """Item ``item_id``'s reply pauses now and the carrier is cleared: what the phone had not
        played of it (None: it had played everything). Forgets all it kept."""
        chunks = [chunk for chunk in self._chunks.values() if chunk[0] == item_id]
        behind = next(iter(self._chunks.values()))[0] != item_id if self._chunks else False  # another reply's tail first
        echoed_at, evicted = self._echoed_at, self._evicted
        self.forget()
        if not chunks:
            return None
        _, start_ms, pcm, sent_at = chunks[0]
        began = max(sent_at, echoed_at or sent_at)  # the first unplayed chunk began to play
        # Not begun while another reply's audio played before it; unknown once older chunks were forgotten.
        played = 0 if behind or evicted else int(np.clip((now - began) * REPLY_RATE, 0, len(pcm)))
        return Held(item_id, start_ms + 1000 * played / REPLY_RATE,
                    np.concatenate([pcm[played:], *(chunk[2] for chunk in chunks[1:])]))
