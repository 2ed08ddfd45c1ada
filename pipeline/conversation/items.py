"""The history edits a client asks for: items added as they are (text, calls, audio recognised
whole), looked up, truncated to what was played, deleted. None starts a turn or a reply; each is
checked first (Refusal, nothing changed)."""
from __future__ import annotations

from typing import Any

import numpy as np

from pipeline.audio_constants import USER_RATE
from pipeline.conversation.refusal import Refusal
from pipeline.conversation.replies import Replies
from pipeline.conversation.shared import Shared
from pipeline.conversation.turns import TurnTaker
from pipeline.errors import E_AUDIO_TOO_FAST, E_INVALID_VALUE, E_ITEM_NOT_FOUND, E_ITEM_TOO_LARGE, E_TURN_TOO_LONG
from pipeline.conversation.history import MAX_ITEM_CHARS, Item, UnknownItem, item_chars


class Items:
    def __init__(self, shared: Shared, turns: TurnTaker, replies: Replies):
        self.shared, self.turns, self.replies = shared, turns, replies

    def _known(self, item_id: Any, param: str = "item_id") -> Item:
        try:
            return self.shared.history.get(item_id)
        except UnknownItem:
            raise Refusal(E_ITEM_NOT_FOUND, f"no item {item_id!r} in this conversation", param) from None

    def item(self, item_id: Any) -> tuple[Item, bool]:
        """An item and whether it is still being made (the running reply's)."""
        reply = self.replies.reply
        if self.replies.running and reply.item_id == item_id:
            return Item("assistant", reply.said, id=reply.item_id, audio=reply.settings.speaks), True
        return self._known(item_id), False

    def added(self, item: Item, after: str | None) -> tuple[Item, str | None]:
        """An item just added, and the one before it (``after`` where the item is not kept)."""
        history = self.shared.history
        return item, history.previous_id(item) if item in history.items else after

    async def add(self, item: Item, after: str | None = None) -> Item:
        """An item added as it is (no turn, no reply), after a known one; at most MAX_ITEM_CHARS."""
        if after not in (None, "root"):
            self._known(after, "previous_item_id")
        if item_chars(item) > MAX_ITEM_CHARS:
            raise Refusal(E_ITEM_TOO_LARGE, f"an item holds at most {MAX_ITEM_CHARS} characters of text, name and "
                                            f"arguments; this one has {item_chars(item)}", "item")
        return self.shared.history.add(item, after)

    async def add_user_audio(self, pcm: np.ndarray, after: str | None = None) -> Item:
        """A user message as audio, recognised whole on a stream of its own; it pays for its audio
        as the microphone does and lasts at most max_turn_s. Raises EngineUnavailable."""
        if after not in (None, "root"):
            self._known(after, "previous_item_id")
        seconds, cfg = len(pcm) / USER_RATE, self.shared.cfg
        if seconds > cfg.max_turn_s:
            raise Refusal(E_TURN_TOO_LONG, f"an item's audio lasts at most {cfg.max_turn_s:g} s (max_turn_s); "
                                           f"this one lasts {seconds:.1f} s", "item.content")
        if not self.turns.paid_item_audio(seconds):
            raise Refusal(E_AUDIO_TOO_FAST, f"audio is arriving faster than {cfg.max_audio_rate:g}x real time "
                                            "(items and microphone together); this item is refused", "item.content")
        text = await self.turns.recogniser.transcribe(pcm, f"{self.shared.id}:item")
        item = self.shared.history.add(Item("user", text.strip(), audio=True), after)
        if item.text and len(pcm):
            self.shared.context.encode_later(item.text, pcm, voice=self.shared.agent.tts_voice())
        return item

    async def truncate(self, item_id: str, audio_end_ms: int) -> Item:
        """Keep only what the client played of an assistant item (the running reply's is cut)."""
        if isinstance(audio_end_ms, bool) or not isinstance(audio_end_ms, int) or audio_end_ms < 0:
            raise Refusal(E_INVALID_VALUE, "audio_end_ms must be a non-negative integer", "audio_end_ms")
        if self.replies.reply is not None and self.replies.reply.item_id == item_id:
            await self.replies.interrupt(send_done=True, reason="client_cancelled")
        item = self._known(item_id)
        try:
            self.shared.history.truncate(item, audio_end_ms)
        except ValueError as exc:
            raise Refusal(E_INVALID_VALUE, str(exc), "audio_end_ms") from None
        return item

    async def delete(self, item_id: str) -> Item:
        item = self._known(item_id)
        self.shared.history.delete(item_id)
        if item.segment is not None:
            self.shared.context.remove(item.segment)
        return item
