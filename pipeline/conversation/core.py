"""One conversation, whatever the wire: typed commands in (``do``), typed events out (``emit``).

The :class:`Conversation` holds the rules every protocol shares. It hears the user's audio through
its :class:`~pipeline.conversation.turns.TurnTaker` and acts on what that decides (barge in, end
the turn); a user turn that ends gets a reply (:class:`~pipeline.conversation.user_turns.UserTurns`,
:class:`~pipeline.conversation.replies.Replies`), unless the client asked to answer only on request;
it checks every command (settings, items, limits) before anything changes, and keeps the history.
It knows what the client played (``Played``: :class:`~pipeline.conversation.playback.Playback`)
and which keys it pressed (:class:`~pipeline.conversation.keypad.Keypad`). It knows no wire format.

An adapter talks to it through :meth:`Conversation.do` and the events it gets back, and the
connection through its lifecycle (``touch``, the deadlines, ``snapshot``/``restore``, ``close``).

Engines fail without taking the conversation with them: every engine call must answer within
``engine_timeout_s`` or fails as ``EngineUnavailable``; the client gets one ``engine_unavailable``
error and the conversation goes on.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from typing import Any, Callable

import numpy as np

from pipeline.audio_constants import REPLY_RATE
from pipeline.conversation import commands as C
from pipeline.conversation.agent import DEFAULT_VOICE
from pipeline.conversation.calls import ToolResultError
from pipeline.conversation.events import (CallOver, Emit, Event, PlaybackCut, ReplyAudio, ReplyDone, ToolCancelled,
                                          TranscriptDelta)
from pipeline.conversation.history import History, new_id
from pipeline.conversation.items import Items
from pipeline.conversation.keypad import Keypad
from pipeline.conversation.voice_offer import LanguageRefused, VoiceOffer
from pipeline.conversation.call_record import CallRecord
from pipeline.conversation.observer import Observer, Observers
from pipeline.conversation.playback import Ending, Playback
from pipeline.conversation.replies import Replies, says_something
from pipeline.conversation.reply import CANCELLED as REPLY_CANCELLED, COMPLETED
from pipeline.conversation.configurator import Configurator
from pipeline.conversation.shared import Shared
from pipeline.conversation.snapshot import Snapshot
from pipeline.conversation.speculation import CANCELLED, Speculator
from pipeline.conversation.tools import ToolFlow
from pipeline.conversation.turns import Lull, SpeakingOn, SpeechEnded, SpeechOver, TurnOver, TurnTaker, Words
from pipeline.conversation.user_turns import UserTurns
from pipeline.conversation.voice_context import VoiceContext
from pipeline.engines import Backends
from pipeline.session_config import SessionConfig

log = logging.getLogger(__name__)


class Conversation:
    def __init__(self, emit: Emit, backends: Backends, cfg: SessionConfig | None = None, session_id: str | None = None,
                 smart_turn=None, voices: tuple[str, ...] = (DEFAULT_VOICE,),
                 clock: Callable[[], float] = time.monotonic, observer: Observer | None = None,
                 wake: asyncio.Event | None = None, holds_playback: bool = False, client_pauses: bool = True,
                 offer: VoiceOffer | None = None):
        cfg = cfg or SessionConfig()
        self.id = session_id or new_id("sess")
        self.changed = asyncio.Event()  # what a resumed conversation would start from changed
        self.wake = wake or asyncio.Event()  # a deadline moved between frames: the receive loop looks again
        self._client_emit = emit
        cfg_now = lambda: self.shared.cfg  # noqa: E731 - the session's settings now (a client may change them)
        self.record = CallRecord(self.id, clock)  # what the call's record keeps (pipeline/records/ stores it)
        self.shared = s = Shared(self.id, backends, self._emit, Observers(observer or Observer(), self.record),
                                 clock, voices, cfg,
                                 History(max_chars=cfg.max_history_chars, on_change=self.changed.set),
                                 VoiceContext(backends, cfg_now, self.changed.set, self.id), changed=self.changed,
                                 offer=offer or VoiceOffer())
        self.turns = TurnTaker(backends, self.id, cfg_now, clock, s.emit, s.error, smart_turn, s.observer.smart_turn,
                               s.observer.stt_final, lambda: self.shared.agent.language)
        self.tools = ToolFlow(s)
        self.speculator = Speculator(s, lambda: self.turns.recogniser)
        self.replies = Replies(s, self.tools, self.speculator, lambda: self.turns.ears, self.wake)
        self.replies.client_pauses = client_pauses  # a paused reply stops playing at the client (not a Realtime WebSocket's)
        self.user_turns = UserTurns(s, self.turns, self.replies, self.speculator)
        self.items = Items(s, self.turns, self.replies)
        self.configurator = Configurator(s, self.turns)
        self.playback = Playback(holds_playback)
        self.keypad = Keypad()
        self._last_activity_at = clock()  # last frame either way (the idle clock)
        self._peek: asyncio.Task | None = None  # the open turn's transcript at its pause, and the LLM on it
        self.closed = False

    async def do(self, command: C.Command) -> Any:
        """Carry out one command; raises BadSetting or Refusal, changing nothing, when refused."""
        # Over 40 lines as one function: one case per command: the command table of docs/conversation.md.
        turns, items = self.user_turns, self.items
        match command:
            case C.Hear(pcm):
                await self._hear(pcm)
            case C.EndTurn(respond, overrides, must_be_open):
                await turns.end_turn(respond, overrides, must_be_open)
            case C.UserText(text, respond, overrides, after):
                return await turns.user_text(text, respond, overrides, after)
            case C.Respond(overrides, metadata):
                return await turns.respond(overrides, metadata)
            case C.CancelReply(response_id):
                await turns.cancel_reply(response_id)
            case C.AddItem(item, after):
                return C.Added(*items.added(await items.add(item, after), after))
            case C.AddUserAudio(pcm, after):
                return C.Added(*items.added(await items.add_user_audio(pcm, after), after))
            case C.GetItem(item_id):
                return items.item(item_id)
            case C.Truncate(item_id, audio_end_ms):
                return await items.truncate(item_id, audio_end_ms)
            case C.DeleteItem(item_id):
                return await items.delete(item_id)
            case C.ClearAudio():
                await self.speculator.drop(CANCELLED)
                await self.turns.clear()
            case C.ToolResult(call_id, output, then):
                return C.Added(*items.added(await self.replies.tool_result(call_id, output, then), None))
            case C.Configure(turn_taking, agent, reply_on_turn_end, voice_clip, greet):
                done = await self.configurator.configure(turn_taking, agent, reply_on_turn_end, voice_clip)
                if greet:
                    await turns.respond()
                return done
            case C.Played(item_id, audio_ms, playing):
                self.replies.played(item_id, audio_ms)
                self.playback.reported(item_id, audio_ms, playing)
                await self._call_over_if_played()
            case C.Digits(digits, as_turn):
                await self._keys(digits, as_turn)
            case C.CollectDigits(call_id, max_digits):
                await self._keys_taken(self.keypad.collect(call_id, max_digits))
            case C.EndCall(within_s, transfer_to):
                self.playback.ending = Ending(transfer_to, self.shared.clock() + within_s)
                self.wake.set()
            case _:
                raise TypeError(f"not a command: {command!r}")

    def touch(self) -> None:
        """Something went either way: the idle clock starts again."""
        self._last_activity_at = self.shared.clock()

    async def _emit(self, ev: Event) -> None:
        """Every event to the client, noted on its way: the audio the client was sent to play, a
        reply it will not play out, calls no longer waited for."""
        if isinstance(ev, ReplyAudio):
            self.playback.sent()
        elif isinstance(ev, ReplyDone):
            if ev.reply.status == COMPLETED:
                self.playback.sent_whole(ev.reply.id, ev.reply.item_id)
            elif ev.reply.status == REPLY_CANCELLED:
                self.playback.dropped()
            if self.playback.ending is not None:
                self.wake.set()  # the call may end once the client has played what it has
        elif isinstance(ev, ToolCancelled):
            self.keypad.cancelled(ev.call.call_id)
        self.record.saw(ev)
        await self._client_emit(ev)

    # ------------------------------------------------------------------ hearing
    async def _hear(self, pcm: np.ndarray) -> None:
        """One microphone frame: the turn taker's decisions, acted on in order."""
        try:
            async with contextlib.aclosing(self.turns.hear(pcm)) as decisions:
                async for decision in decisions:
                    await self._decided(decision)
        finally:
            await self._peeked()

    async def _decided(self, d) -> None:
        replies, cfg, turn = self.replies, self.shared.cfg, self.turns.user_turn
        if isinstance(d, SpeechOver):
            if replies.interruptible():
                await replies.barge_in(turn.partial, self.turns.speech_started_at)
            elif not replies.running and (playing := self.playback.cuttable()) is not None:
                await self._cut_playback(*playing)
                if self.turns.speech_started_at is not None:
                    self.shared.observer.barge_in(self.shared.clock() - self.turns.speech_started_at)
            if self.tools.waiting:  # the user speaks over a pending tool call: it is not waited for any more
                await replies.cancel_calls()
        elif isinstance(d, Words):
            if replies.paused and says_something(d.text, cfg.backchannel_words):
                await replies.interrupt(send_done=True)  # words: a turn, not a backchannel
            elif d.may_barge_in and replies.interruptible():
                await replies.barge_in(d.text, self.turns.speech_started_at)
            await self.shared.emit(TranscriptDelta(self.shared.turn + 1, turn.item_id, d.delta, d.text))
        elif isinstance(d, SpeechEnded):
            if replies.paused and d.speech_ms <= cfg.backchannel_max_ms:  # a backchannel's length: judged now
                await self._peeked()
                await self.user_turns.end_spoken("short")
        elif isinstance(d, SpeakingOn):
            await self.speculator.speaking_on()
        elif isinstance(d, Lull) and cfg.preemptive_generation and self.shared.reply_on_turn_end \
                and not self.tools.waiting:
            # the turn's transcript as it would end now, and its reply started ahead, while the pause grows
            self._peek = asyncio.create_task(self.speculator.foresee(turn.item_id, turn.joined_audio()))
        elif isinstance(d, TurnOver):
            await self._peeked()
            if d.by == "max_turn":
                await self.turns.too_long_error()
            finished = self.speculator.transcript(turn.item_id) if d.by == "smart_turn" else None
            await self.user_turns.end_spoken(d.by, finished=finished)

    async def _peeked(self) -> None:
        peek, self._peek = self._peek, None
        if peek is not None:
            await peek

    # ------------------------------------------------------------------ the client's playback, its keys
    async def _cut_playback(self, reply_id: str, item_id: str, heard_ms: float | None) -> None:
        """Speech over a reply sent whole that still plays (where the server holds the playback):
        the client drops the rest, and its item keeps what was heard."""
        self.playback.dropped()
        known = any(i.id == item_id for i in self.shared.history.items)
        end = max(0, int(heard_ms)) if heard_ms is not None and known else None
        if end is not None:
            await self.items.truncate(item_id, end)
        await self.shared.emit(PlaybackCut(reply_id, item_id, end))

    async def _call_over_if_played(self) -> None:
        ending = self.playback.call_over(self.shared.clock(), self.replies.running)
        if ending is not None:
            await self.shared.emit(CallOver(ending.transfer_to))

    async def _keys(self, digits: str, as_turn: bool) -> None:
        if as_turn:
            await self.user_turns.user_text(f"(The caller pressed {' '.join(digits)} on the keypad.)")
        else:
            await self._keys_taken(self.keypad.press(digits))

    async def _keys_taken(self, taken: tuple[str, str] | None) -> None:
        """A collect_digits call has its keys: they are its result, and a reply uses them."""
        if taken is not None:
            try:
                await self.replies.tool_result(*taken, "respond")
            except ToolResultError as exc:  # the caller spoke over it: the call was cancelled
                log.info("session %s: keys for %s not used: %s", self.id, taken[0], exc.message)

    # ------------------------------------------------------------------ deadlines and lifecycle
    def next_deadline(self) -> float:
        """When :meth:`check_deadlines` next has work: the open turn's ``max_turn_s``, the end of a
        hands-free pause, a tool call's filler or timeout, a call's end, or the idle limit."""
        ending = self.playback.due(self.shared.clock(), self.replies.running)
        return min(t for t in (self._idle_deadline(), self.turns.turn_deadline(), self.turns.user_turn.eot_deadline,
                               self.tools.deadline(), ending) if t is not None)

    async def check_deadlines(self) -> float | None:
        """Act on deadlines that passed; the idle limit once nothing went either way for
        ``idle_timeout_s`` (else None)."""
        while (due := self.turns.due()) is not None:
            await self._decided(due)
        await self.replies.check_calls()
        await self._call_over_if_played()
        return self.shared.cfg.idle_timeout_s if self.shared.clock() >= self._idle_deadline() else None

    def _idle_deadline(self) -> float:
        if self.replies.running:
            # Waiting for a reply is not idleness (it may queue behind others' TTS): look again later.
            return self.shared.clock() + self.shared.cfg.idle_timeout_s
        return self._last_activity_at + self.shared.cfg.idle_timeout_s

    def snapshot(self, in_flight: bool = False) -> Snapshot:
        """What a resumed conversation starts from (pipeline/resume/); ``in_flight``: with the reply
        being sent when the connection ended."""
        s = self.shared
        return Snapshot(s.id, s.turn, list(s.history.items), s.agent, list(s.context.segments),
                        self.replies.in_flight if in_flight else None, time.time())

    def restore(self, snap: Snapshot, generation: int, received: tuple[int | None, int | None]) -> None:
        """Continue the conversation ``snap`` was taken of; a reply that was in flight ends at what
        the client received (the turn and seq of its last audio message; (None, None): all)."""
        s = self.shared
        s.turn, s.agent, s.context.segments = snap.turn, snap.agent, list(snap.context)
        try:  # resumed on a server that no longer serves its language (or voice for it): the default
            s.offer.check(s.agent.language, s.agent.voice)
        except LanguageRefused as exc:
            log.warning("session %s resumed without its language: %s", s.id, exc)
            s.agent = dataclasses.replace(s.agent, language=None)
        for item in snap.items:
            s.history.add(item)
        self.replies.done_turn = self.replies.seq_turn = snap.turn  # the turns before are over
        # a stream the dropped session left open on the recogniser never collides with this one's
        self.turns.recogniser.stream_id = f"{s.id}.{generation}"
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
        await self.turns.recogniser.release()
