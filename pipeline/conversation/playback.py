"""The client's playback, as the conversation knows it: what it was sent and what it reports
having played (``Played``). Two rules rest on it:

- **speech over a reply that was sent whole but still plays** cuts it, where the server holds the
  client's playback buffer (a WebRTC call: ``holds_playback``): the client drops the rest
  (``PlaybackCut``) and the reply's item keeps what was heard. Where the client holds its own
  buffer (a WebSocket), it stops playing by itself and truncates the item if it wants to.
- **a call the agent ended** (``EndCall``) ends once the agent's last words have played, or at its
  deadline: ``CallOver`` says so, and the wire hangs up.

``playing`` is true from the first audio sent until the client reports it has played everything
(``Played(playing=False)``), and false again at once when a reply is cut (the client drops what it
has not played). A wire that never reports keeps it true: neither rule then fires.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Ending:
    """The agent ended the call: transferred to ``transfer_to`` (None: hung up), once its words have
    played, at ``by`` at the latest."""

    transfer_to: str | None
    by: float


class Playback:
    def __init__(self, holds_playback: bool):
        self.holds_playback = holds_playback
        self.playing = False  # audio was sent that the client has not reported played
        self.item_id: str | None = None  # the item of the last report
        self.heard_ms = 0.0  # how far into it the client played
        self.last_done: tuple[str, str] | None = None  # (reply id, item id) of the last reply sent whole
        self.ending: Ending | None = None

    def sent(self) -> None:
        self.playing = True

    def dropped(self) -> None:
        """A cut reply: the client drops what it has not played."""
        self.playing = False
        self.last_done = None

    def reported(self, item_id: str, audio_ms: float, playing: bool) -> None:
        self.item_id, self.heard_ms, self.playing = item_id, audio_ms, playing

    def sent_whole(self, reply_id: str, item_id: str) -> None:
        self.last_done = (reply_id, item_id)

    def cuttable(self) -> tuple[str, str, float | None] | None:
        """(reply id, item id, ms heard of it: None where the client reported none) of a reply sent
        whole that the client still plays, where the server holds the playback; else None."""
        if not (self.holds_playback and self.playing and self.last_done is not None):
            return None
        reply_id, item_id = self.last_done
        return reply_id, item_id, self.heard_ms if self.item_id == item_id else None

    def due(self, now: float, replying: bool) -> float | None:
        """When the ending is due: now once the last words have played, else its deadline."""
        if self.ending is None:
            return None
        return now if not (self.playing or replying) else self.ending.by

    def call_over(self, now: float, replying: bool) -> Ending | None:
        """The ending, once the call's last words have played (or its time is up); taken once."""
        ending = self.ending
        if ending is None or (now < ending.by and (self.playing or replying)):
            return None
        self.ending = None
        return ending
