"""One conversation, whatever the wire: typed commands in (``do``), typed events out (``emit``).

The :class:`Conversation` holds the rules every protocol shares. It hears the user's audio through
its :class:`~pipeline.conversation.turns.TurnTaker` and acts on what that decides (barge in, end
the turn); a user turn that ends gets a reply (:class:`~pipeline.conversation.replies.Replies`),
unless the client asked to answer only on request; it checks every command (settings, items,
limits) before anything changes, and keeps the history. It knows no wire format.

Engines fail without taking the conversation with them: every engine call must answer within
``engine_timeout_s`` or fails as ``EngineUnavailable``; the client gets one ``engine_unavailable``
error and the conversation goes on.
"""
from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any, Callable

import numpy as np

from pipeline.conversation.agent import DEFAULT_VOICE
from pipeline.conversation.allowance import Allowance
from pipeline.audio_constants import REPLY_RATE
from pipeline.conversation import commands as C
from pipeline.conversation.events import Emit, TranscriptDelta, TurnEnded
from pipeline.conversation.items import Items
from pipeline.conversation.observer import Observer
from pipeline.conversation.refusal import Refusal
from pipeline.conversation.replies import Replies, says_something
from pipeline.conversation.reply import Reply
from pipeline.conversation.settings import Settings
from pipeline.conversation.shared import Shared
from pipeline.conversation.tools import ToolFlow
from pipeline.conversation.turns import Heard, Pause, SpeakingOn, SpeechOver, TurnOver, TurnTaker, Words
from pipeline.conversation.voice_context import VoiceContext
from pipeline.engines import Backends
from pipeline.errors import E_ACTIVE_RESPONSE, E_CANCEL_NOT_ACTIVE, E_RATE_LIMITED
from pipeline.conversation.history import History, Item, new_id
from pipeline.conversation.snapshot import Snapshot
from pipeline.session_config import SessionConfig
from pipeline.conversation.speculation import CANCELLED, MISS, Speculator


class Conversation:
    def __init__(self, emit: Emit, backends: Backends, cfg: SessionConfig | None = None, session_id: str | None = None,
                 smart_turn=None, voices: tuple[str, ...] = (DEFAULT_VOICE,),
                 clock: Callable[[], float] = time.monotonic, observer: Observer | None = None):
        cfg, sid, changed = cfg or SessionConfig(), session_id or new_id("sess"), asyncio.Event()
        settings = lambda: self.shared.cfg  # noqa: E731 - the settings now (a client may change them)
        self.shared = s = Shared(sid, backends, emit, observer or Observer(), clock, voices, cfg,
                                 History(max_chars=cfg.max_history_chars, on_change=changed.set),
                                 VoiceContext(backends, settings, changed.set, sid), changed=changed)
        self.turns = TurnTaker(backends, sid, settings, clock, emit, s.error, smart_turn, s.observer.smart_turn)
        self.tools = ToolFlow(s)
        self.speculator = Speculator(backends.llm_stream, lambda: s.cfg.engine_timeout_s, s.observer.speculation)
        self.replies = Replies(s, self.tools, self.speculator, lambda: self.turns.ears)
        self.items = Items(s, self.turns, self.replies)
        self.settings = Settings(s, self.turns)
        self.reply_allowance = Allowance(cfg.max_replies_per_minute / 60, cfg.replies_burst, clock)
        self._last_activity_at = clock()  # last frame either way (the idle clock)
        self._peek: asyncio.Task | None = None  # the open turn's transcript at its pause, and the LLM on it
        self.closed = False

    # What adapters, tools and tests read
    id = property(lambda self: self.shared.id)
    cfg = property(lambda self: self.shared.cfg)
    agent = property(lambda self: self.shared.agent)
    history = property(lambda self: self.shared.history)
    context = property(lambda self: self.shared.context.segments)
    turn = property(lambda self: self.shared.turn)
    reply = property(lambda self: self.replies.reply)
    heard = property(lambda self: self.turns.heard)
    recogniser = property(lambda self: self.turns.recogniser)
    eot_probabilities = property(lambda self: self.turns.eot_probabilities)
    speculations = property(lambda self: self.speculator.outcomes)
    state_changed = property(lambda self: self.shared.changed)
    deadline_changed = property(lambda self: self.replies.deadline_changed)
    reply_on_turn_end = property(lambda self: self.shared.reply_on_turn_end)

    async def do(self, command: C.Command) -> Any:
        """Carry out one command; raises BadSetting or Refusal, changing nothing, when refused."""
        return await _DO[type(command)](self, command)

    def touch(self) -> None:
        """Something went either way: the idle clock starts again."""
        self._last_activity_at = self.shared.clock()

    # ------------------------------------------------------------------ hearing
    async def hear(self, pcm: np.ndarray) -> None:
        """One microphone frame: the turn taker's decisions, acted on in order."""
        try:
            async with contextlib.aclosing(self.turns.hear(pcm)) as decisions:
                async for decision in decisions:
                    await self._decided(decision)
        finally:
            await self._peeked()

    async def _decided(self, d) -> None:
        replies, cfg = self.replies, self.shared.cfg
        if isinstance(d, SpeechOver):
            if replies.interruptible():
                await replies.barge_in(self.heard.partial)
            if self.tools.waiting:  # the user speaks over a pending tool call: it is not waited for any more
                await replies.cancel_calls()
        elif isinstance(d, Words):
            if replies.paused and says_something(d.text, cfg.backchannel_words):
                await replies.interrupt(send_done=True)  # words: a turn, not a backchannel
            elif d.may_barge_in and replies.interruptible():
                await replies.barge_in(d.text)
            await self.shared.emit(TranscriptDelta(self.shared.turn + 1, self.heard.item_id, d.delta, d.text))
        elif isinstance(d, SpeakingOn):
            await self.speculator.drop(CANCELLED)  # the user speaks on
        elif isinstance(d, Pause) and cfg.preemptive_generation and self.shared.reply_on_turn_end \
                and not self.tools.waiting:
            # the turn's transcript as it would end now, and the LLM on it, while Smart Turn decides
            self._peek = asyncio.create_task(self._peek_and_speculate())
        elif isinstance(d, TurnOver):
            finished = await self._peeked()
            if d.by == "max_turn":
                await self.turns.too_long_error()
            await self._end_spoken(d.by, finished=finished if d.by == "smart_turn" else None)

    async def _peek_and_speculate(self) -> tuple[str, list[dict]] | None:
        finished = await self.recogniser.peek()
        text = finished[0].strip() if finished is not None else ""
        if not text:
            await self.speculator.drop(CANCELLED)
        else:
            agent = self.shared.agent
            await self.speculator.start(agent.messages(self.history.messages() + [{"role": "user", "content": text}]),
                                        agent.sampling())
        return finished

    async def _peeked(self) -> tuple[str, list[dict]] | None:
        peek, self._peek = self._peek, None
        return await peek if peek is not None else None

    # ------------------------------------------------------------------ turns
    async def end_turn(self, respond: bool = True, overrides: dict[str, Any] | None = None) -> None:
        """The client ended the spoken turn (push-to-talk, commit)."""
        self._check(overrides)
        if not self.turns.ended_already():
            await self._end_spoken("turn_end", respond, overrides)

    async def user_text(self, text: str, respond: bool = True, overrides: dict[str, Any] | None = None,
                        after: str | None = None) -> Item:
        """A typed user turn. Spoken audio in flight becomes its own turn first."""
        self._check(overrides)
        self._pay_for_reply()
        ended_at = self.shared.clock()
        if self.heard.open:
            await self._end_spoken("turn_end", respond)
        await self._cut()
        item_id = self.heard.item_id
        self.recogniser.drop()
        self.turns.ended_by_server = False
        return await self._turn_over(Heard(text, None, None), item_id, "typed", respond, overrides, ended_at, after)

    async def _end_spoken(self, by: str, respond: bool | None = None, overrides: dict[str, Any] | None = None,
                          finished: tuple[str, list[dict]] | None = None) -> Item | None:
        """End the spoken turn; ``by``: what ended it. A reply paused by it goes on if all it said
        was a backchannel; ``finished``: its transcript, already had from a peek."""
        ended_at, item_id, paused = self.shared.clock(), self.heard.item_id, self.replies.paused
        if not paused and not (self.heard.open and not self.heard.holds_slot):
            await self._cut()
        heard = await self.turns.conclude(by, finished)
        if heard is not None and paused and not says_something(heard.text, self.shared.cfg.backchannel_words):
            heard = None  # a backchannel, or nothing: no turn, no number
        if heard is None:
            await self.speculator.drop(MISS)
            await self.replies.resume()
            return None
        if paused:
            await self._cut()
        return await self._turn_over(heard, item_id, by, respond, overrides, ended_at)

    async def _cut(self) -> None:
        """A new user turn: pending tool calls and the running reply end."""
        await self.replies.cancel_calls()
        await self.replies.interrupt(send_done=True, reason="turn_detected")

    async def _turn_over(self, heard: Heard, item_id: str, by: str, respond: bool | None,
                         overrides: dict[str, Any] | None, ended_at: float, after: str | None = None) -> Item:
        """The turn gets its number and its item (unless empty), the client hears of it, and, if
        ``respond`` (None: as ``reply_on_turn_end`` says), its reply starts."""
        s, history = self.shared, self.shared.history
        s.turn += 1
        s.changed.set()
        item = Item("user", heard.text.strip(), id=item_id, audio=by != "typed")
        if item.text:
            history.add(item, after)
            if heard.audio is not None:  # encoded once, beside the LLM's first tokens, for the TTS context
                s.context.encode_later(item.text, heard.audio)
        previous = history.previous_id(item) if item in history.items else (history.last.id if history.last else None)
        await s.emit(TurnEnded(s.turn, item, heard.text, heard.words, previous, self.turns.take_heard_s()))
        s.observer.turn_ended(by)
        if s.reply_on_turn_end if respond is None else respond:
            await self.replies.start(ended_at, overrides or {}, answers=item.text)
        else:
            await self.speculator.drop(MISS)
        return item

    # ------------------------------------------------------------------ replies
    async def respond(self, overrides: dict[str, Any] | None = None) -> Reply:
        """Start a reply to the conversation so far; one at a time, and rate-limited."""
        if self.replies.running:
            raise Refusal(E_ACTIVE_RESPONSE, f"response {self.reply.id} is still in progress; cancel it or wait for "
                                             "its response.done")
        self._check(overrides)
        self._pay_for_reply()
        return await self.replies.start(self.shared.clock(), overrides or {})

    async def cancel_reply(self, response_id: str | None = None) -> None:
        """Cancel the running reply (``response_id``: only if it is that one)."""
        if not self.replies.running or response_id not in (None, self.reply.id):
            raise Refusal(E_CANCEL_NOT_ACTIVE, "there is no active response to cancel", "response_id")
        await self.replies.interrupt(send_done=True, reason="client_cancelled")

    def _check(self, overrides: dict[str, Any] | None) -> None:
        """A reply's own settings, checked before anything happens (raises BadSetting)."""
        if overrides:
            self.shared.agent.updated(overrides, self.shared.voices)

    def _pay_for_reply(self) -> None:
        """A reply the client asks for (a typed turn, response.create) pays from the reply allowance."""
        if not self.reply_allowance.take(1):
            cfg = self.shared.cfg
            raise Refusal(E_RATE_LIMITED, f"at most {cfg.max_replies_per_minute} replies a minute are asked for "
                                          f"(typed turns and response.create; {cfg.replies_burst} at once): this "
                                          "one is refused")

    async def tool_result(self, call_id: str, output: str, then: str | None = None) -> Item:
        """The client's result of a call (raises calls.ToolResultError, changing nothing)."""
        return await self.replies.tool_result(call_id, output, then)

    async def played(self, item_id: str, audio_ms: float) -> None:
        self.replies.played(item_id, audio_ms)

    async def clear_audio(self) -> None:
        """Drop the open spoken turn's audio."""
        await self.speculator.drop(CANCELLED)
        await self.turns.clear()


    # ------------------------------------------------------------------ deadlines and lifecycle
    def next_deadline(self) -> float:
        """When :meth:`check_deadlines` next has work: the open turn's ``max_turn_s``, the end of a
        hands-free pause, a tool call's filler or timeout, or the idle limit."""
        return min(t for t in (self._idle_deadline(), self.turns.turn_deadline(), self.heard.eot_deadline,
                               self.tools.deadline()) if t is not None)

    async def check_deadlines(self) -> bool:
        """Act on deadlines that passed; True once nothing went either way for ``idle_timeout_s``."""
        while (due := self.turns.due()) is not None:
            await self._decided(due)
        await self.replies.check_calls()
        return self.shared.clock() >= self._idle_deadline()

    def _idle_deadline(self) -> float:
        if self.replies.running:
            # Waiting for a reply is not idleness (it may queue behind others' TTS): look again later.
            return self.shared.clock() + self.shared.cfg.idle_timeout_s
        return self._last_activity_at + self.shared.cfg.idle_timeout_s

    def snapshot(self, in_flight=None) -> Snapshot:
        """What a resumed conversation starts from (pipeline/resume/tokens.py); ``in_flight``: the reply
        being sent when the connection ended (``replies.in_flight``)."""
        s = self.shared
        return Snapshot(s.id, s.turn, list(s.history.items), s.agent, list(s.context.segments), in_flight,
                        time.time())

    def restore(self, snap: Snapshot, generation: int, received: tuple[int | None, int | None]) -> None:
        """Continue the conversation ``snap`` was taken of; a reply that was in flight ends at what
        the client received (the turn and seq of its last audio message; (None, None): all)."""
        s = self.shared
        s.turn, s.agent, s.context.segments = snap.turn, snap.agent, list(snap.context)
        for item in snap.items:
            s.history.add(item)
        self.replies.done_turn = self.replies.seq_turn = snap.turn  # the turns before are over
        # a stream the dropped session left open on the recogniser never collides with this one's
        self.recogniser.stream_id = f"{s.id}.{generation}"
        flight = snap.in_flight
        item = next((i for i in s.history.items if flight is not None and i.id == flight.item_id), None)
        if item is not None and item.audio and received != (None, None):
            samples = min(flight.samples_received(*received), item.audio_samples)
            s.history.truncate(item, 1000 * samples / REPLY_RATE)

    async def stop_replying(self) -> None:
        """The connection is about to end (a draining replica): the reply ends at its chunk."""
        await self.replies.stop()

    async def close(self) -> None:
        """Cancel everything this conversation started and release an STT slot its open turn holds."""
        if self.closed:
            return
        self.closed = True
        await self.speculator.drop(CANCELLED)
        await self.replies.interrupt(send_done=False)
        self.shared.context.cancel()
        await self.recogniser.release()


_DO: dict[type, Callable] = {
    C.Hear: lambda c, x: c.hear(x.pcm),
    C.EndTurn: lambda c, x: c.end_turn(x.respond, x.overrides),
    C.UserText: lambda c, x: c.user_text(x.text, x.respond, x.overrides, x.after),
    C.AddItem: lambda c, x: c.items.add(x.item, x.after),
    C.AddUserAudio: lambda c, x: c.items.add_user_audio(x.pcm, x.after),
    C.Respond: lambda c, x: c.respond(x.overrides),
    C.CancelReply: lambda c, x: c.cancel_reply(x.response_id),
    C.Played: lambda c, x: c.played(x.item_id, x.audio_ms),
    C.Digits: lambda c, x: c.user_text(f"(The caller pressed {' '.join(x.digits)} on the keypad.)"),
    C.ClearAudio: lambda c, x: c.clear_audio(),
    C.Truncate: lambda c, x: c.items.truncate(x.item_id, x.audio_end_ms),
    C.DeleteItem: lambda c, x: c.items.delete(x.item_id),
    C.ToolResult: lambda c, x: c.tool_result(x.call_id, x.output, x.then),
    C.Configure: lambda c, x: c.settings.configure(x.turn_taking, x.agent, x.reply_on_turn_end, x.voice_clip),
}
