"""User turns as they end, and the replies they (or the client) ask for.

A spoken turn ends when the turn taker decides so (hands-free) or the client says so (push-to-talk,
commit); a typed turn ends at once. Either way it gets its number and its history item, the client
hears of it (``TurnEnded``), and, unless the client answers only on request, its reply starts. A
new turn first ends what came before it: pending tool calls and the running reply. Replies the
client asks for itself (typed turns, ``response.create``) are one at a time and rate-limited.
"""
from __future__ import annotations

from typing import Any

from pipeline.conversation.allowance import Allowance
from pipeline.conversation.events import TurnEnded
from pipeline.conversation.history import Item
from pipeline.conversation.refusal import Refusal
from pipeline.conversation.replies import Replies, says_something
from pipeline.conversation.reply import Reply
from pipeline.conversation.shared import Shared
from pipeline.conversation.speculation import MISS, Speculator
from pipeline.conversation.turns import Transcript, TurnTaker
from pipeline.errors import E_ACTIVE_RESPONSE, E_CANCEL_NOT_ACTIVE, E_NO_OPEN_TURN, E_RATE_LIMITED


class UserTurns:
    def __init__(self, shared: Shared, turns: TurnTaker, replies: Replies, speculator: Speculator):
        self.shared, self.turns, self.replies, self.speculator = shared, turns, replies, speculator
        cfg = shared.cfg
        self.allowance = Allowance(cfg.max_replies_per_minute / 60, cfg.replies_burst, shared.clock)

    async def end_turn(self, respond: bool | None = True, overrides: dict[str, Any] | None = None,
                       must_be_open: bool = False) -> None:
        """The client ended the spoken turn (push-to-talk, commit). ``respond`` None: a reply
        follows where the server takes turns hands-free and answers them (``reply_on_turn_end``);
        ``must_be_open``: refused (``no_open_turn``) when no audio was heard since the last turn."""
        self.check(overrides)
        if must_be_open and not self.turns.user_turn.open:
            raise Refusal(E_NO_OPEN_TURN, "no audio since the last turn ended")
        if respond is None:
            respond = self.shared.reply_on_turn_end and self.shared.cfg.turn_detection == "vad"
        if not self.turns.ended_already():
            await self.end_spoken("turn_end", respond, overrides)

    async def user_text(self, text: str, respond: bool = True, overrides: dict[str, Any] | None = None,
                        after: str | None = None) -> Item:
        """A typed user turn. Spoken audio in flight becomes its own turn first."""
        self.check(overrides)
        self.pay_for_reply()
        ended_at = self.shared.clock()
        if self.turns.user_turn.open:
            await self.end_spoken("turn_end", respond)
        await self.cut()
        item_id = self.turns.user_turn.item_id
        self.turns.recogniser.drop()
        self.turns.ended_by_server = False
        return await self._turn_over(Transcript(text, None, None), item_id, "typed", respond, overrides, ended_at, after)

    async def end_spoken(self, by: str, respond: bool | None = None, overrides: dict[str, Any] | None = None,
                         finished: tuple[str, list[dict]] | None = None) -> Item | None:
        """End the spoken turn; ``by``: what ended it. A reply paused by it goes on if all it said
        was a backchannel; ``finished``: its transcript, already had from a peek."""
        turn = self.turns.user_turn
        ended_at, item_id, paused = self.shared.clock(), turn.item_id, self.replies.paused
        if not paused and not (turn.open and not turn.holds_slot):
            await self.cut()
        speech_end = self.turns.speech_end(by, ended_at)
        words = await self.turns.conclude(by, finished, speech_end)
        if words is not None and paused and not says_something(words.text, self.shared.cfg.backchannel_words):
            words = None  # a backchannel, or nothing: no turn, no number
        if words is None:
            await self.speculator.drop(MISS)
            await self.replies.resume()
            return None
        if paused:
            await self.cut()
        return await self._turn_over(words, item_id, by, respond, overrides, ended_at, speech_end=speech_end)

    async def cut(self) -> None:
        """A new user turn: pending tool calls and the running reply end."""
        await self.replies.cancel_calls()
        await self.replies.interrupt(send_done=True, reason="turn_detected")

    async def _turn_over(self, said: Transcript, item_id: str, by: str, respond: bool | None,
                         overrides: dict[str, Any] | None, ended_at: float, after: str | None = None,
                         speech_end: float | None = None) -> Item:
        """The turn gets its number and its item (unless empty), the client hears of it, and, if
        ``respond`` (None: as ``reply_on_turn_end`` says), its reply starts."""
        s, history = self.shared, self.shared.history
        s.turn += 1
        s.changed.set()
        item = Item("user", said.text.strip(), id=item_id, audio=by != "typed")
        if item.text:
            history.add(item, after)
            if said.audio is not None:  # encoded once, beside the LLM's first tokens, for the TTS context
                s.context.encode_later(item.text, said.audio, self.speculator.user_codes(item.text), s.agent.tts_voice())
        previous = history.previous_id(item) if item in history.items else (history.last.id if history.last else None)
        await s.emit(TurnEnded(s.turn, item, said.text, said.words, previous, self.turns.take_audio_s()))
        s.observer.turn_ended(by)
        if s.reply_on_turn_end if respond is None else respond:
            await self.replies.start(ended_at, overrides or {}, answers=item.text, speech_end=speech_end)
        else:
            await self.speculator.drop(MISS)
        return item

    async def respond(self, overrides: dict[str, Any] | None = None, metadata: Any = None) -> Reply:
        """Start a reply to the conversation so far; one at a time, and rate-limited."""
        if self.replies.running:
            raise Refusal(E_ACTIVE_RESPONSE, f"response {self.replies.reply.id} is still in progress; cancel it or "
                                             "wait for its response.done")
        self.check(overrides)
        self.pay_for_reply()
        return await self.replies.start(self.shared.clock(), overrides or {}, metadata=metadata)

    async def cancel_reply(self, response_id: str | None = None) -> None:
        """Cancel the running reply (``response_id``: only if it is that one)."""
        if not self.replies.running or response_id not in (None, self.replies.reply.id):
            raise Refusal(E_CANCEL_NOT_ACTIVE, "there is no active response to cancel", "response_id")
        await self.replies.interrupt(send_done=True, reason="client_cancelled")

    def check(self, overrides: dict[str, Any] | None) -> None:
        """A reply's own settings, checked before anything happens (raises BadSetting)."""
        if overrides:
            self.shared.agent.updated(overrides, self.shared.voices, self.shared.offer)

    def pay_for_reply(self) -> None:
        """A reply the client asks for (a typed turn, response.create) pays from the reply allowance."""
        if not self.allowance.take(1):
            cfg = self.shared.cfg
            raise Refusal(E_RATE_LIMITED, f"at most {cfg.max_replies_per_minute} replies a minute are asked for "
                                          f"(typed turns and response.create; {cfg.replies_burst} at once): this "
                                          "one is refused")
