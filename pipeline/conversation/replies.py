"""The replies of one conversation and the response lifecycle: at most one reply runs; it is
started, paused, resumed or cut here, and what it said joins the history.

A turn's response may take several replies (one that calls tools, a filler while their results
are awaited, the one that uses them): :class:`Replies` numbers the response's audio across them
and says once when the turn's response is over (:class:`~pipeline.conversation.events.TurnDone`).
It is the :class:`~pipeline.conversation.reply.ReplyHost` of its replies.
"""
from __future__ import annotations

import asyncio
import dataclasses
from typing import Any, Callable

import numpy as np

from pipeline.audio_constants import REPLY_RATE
from pipeline.conversation.events import (ReplyAudio, ReplyDone, ReplyPaused, ReplyResumed, ReplyStarted, ReplyText,
                                          ToolCallAsked, ToolCancelled, TurnDone)
from pipeline.conversation.shared import Shared
from pipeline.conversation.tools import ToolFlow
from pipeline.engines import BOT_SPEAKER, Segment, ToolCall, Voice
from pipeline.conversation.history import Item
from pipeline.conversation.ears.listening import Listener
from pipeline.conversation.reply import CANCELLED, Reply
from pipeline.conversation.snapshot import InFlight
from pipeline.conversation.speculation import CANCELLED as SPECULATION_CANCELLED, Speculator


def says_something(text: str, backchannel_words: tuple[str, ...]) -> bool:
    """Whether ``text`` holds a word that is not a backchannel ("mm-hm", "yeah", ...)."""
    words = [w.strip(".,!?;:'\"-").lower() for w in text.split()]
    return any(w and w not in backchannel_words for w in words)


class Replies:
    def __init__(self, shared: Shared, tools: ToolFlow, speculator: Speculator, ears: Callable[[], Listener | None],
                 wake: asyncio.Event):
        self.shared, self.tools, self.speculator, self.ears = shared, tools, speculator, ears
        self.reply: Reply | None = None  # the last one started
        self.wake = wake  # set when a tool call's clocks started between frames
        self.done_turn = 0  # the last turn whose response is over
        self._open_turn: int | None = None  # a turn whose response waits on tool results
        self.seq_turn, self._seq = 0, 0  # the response's audio count, across its replies
        self.in_flight: InFlight | None = None  # the audio of the last reply that sent any, by seq
        self.client_pauses = True  # a paused reply stops playing at the client, which keeps the rest

    # what a Reply reads of its host
    cfg = property(lambda self: self.shared.cfg)
    backends = property(lambda self: self.shared.backends)
    clock = property(lambda self: self.shared.clock)
    observer = property(lambda self: self.shared.observer)

    @property
    def running(self) -> bool:
        return self.reply is not None and self.reply.running

    @property
    def paused(self) -> bool:
        return self.running and self.reply.paused

    def played(self, item_id: str, audio_ms: float) -> None:
        """The client played the running reply up to ``audio_ms``; later reports only move it on."""
        reply = self.reply
        if reply is not None and reply.running and reply.item_id == item_id:
            reply.played = max(reply.played or 0, min(int(audio_ms * REPLY_RATE / 1000), reply.samples))

    def interruptible(self) -> bool:
        if not self.running:
            return False
        if self.reply.first_audio_at is None:
            return True  # nothing played yet: the user simply talks on
        return self.shared.clock() - self.reply.first_audio_at >= self.shared.cfg.barge_in_grace_s

    # ------------------------------------------------------------------ lifecycle
    async def start(self, ended_at: float, overrides: dict[str, Any], answers: str | None = None,
                    script: str | None = None, record: bool = True, metadata: Any = None,
                    speech_end: float | None = None) -> Reply:
        """A reply to the history as it is; ``answers``: the user turn it answers ("": an empty
        turn, which gets a reply that ends at once). ``overrides``: agent settings of this reply
        only (checked already). ``script``: a fixed text to say instead of the LLM's; ``record``:
        whether what it says joins the history; ``metadata``: the client's, carried by the reply."""
        s = self.shared
        settings = s.agent.updated(overrides, s.voices, s.offer) if overrides else s.agent
        last = s.history.last
        if last is not None and last.kind == "function_call_output" and settings.tool_choice != "none":
            # a reply to tool results may call again, but is not made to: "required" would loop forever
            settings = dataclasses.replace(settings, tool_choice="auto")
        messages = None if answers == "" else settings.messages(s.history.messages())
        ahead = await self.speculator.take(messages, settings.sampling()) \
            if script is None and messages is not None else None
        reply = self.reply = Reply(self, s.turn, messages, settings, ended_at, s.context.take_encoding(), overrides,
                                   script, record, ahead=ahead, metadata=metadata, speech_end=speech_end)
        await s.emit(ReplyStarted(reply, last.id if last is not None else None))
        reply.start()
        return reply

    async def interrupt(self, send_done: bool, reason: str = "turn_detected") -> None:
        """Cut the running reply: nothing more of it is sent, and the history keeps what was said."""
        reply, self.reply = self.reply, None
        if reply is None or not reply.running:
            return
        # Once cancelled, the reply task sends nothing more (its next await raises), so the client
        # hears of the interruption at once, not after the engines have let go of its work.
        reply.task.cancel()
        reply.status, reply.reason = CANCELLED, reason
        if (ears := self.ears()) is not None:
            ears.stop_playback()  # the client drops what it has not played
        if reason == "turn_detected" or reply.calls:  # the user spoke, or the calls were this reply's
            await self.cancel_calls()
        if send_done and not reply.done_sent:
            await self._done(reply)
        await asyncio.gather(reply.task, return_exceptions=True)
        self._remember(reply)
        if reason != "server_shutdown":
            self.shared.observer.interrupted()

    async def stop(self) -> None:
        """The connection is about to end (a draining replica): no preemptive LLM; the reply ends at
        the chunk it is at, and the history keeps what it said so far."""
        await self.speculator.drop(SPECULATION_CANCELLED)
        await self.interrupt(send_done=True, reason="server_shutdown")

    async def barge_in(self, partial: str, onset: float | None = None) -> None:
        """The user speaks over the playing reply: it ends; or, with ``resume_false_interruption``,
        while nothing they said so far is more than a backchannel, it pauses until their speech
        ends as a turn (then it ends) or as no turn (then it resumes). ``onset``: when their speech
        began (the barge-in's latency, where the reply's audio was playing, is counted from it)."""
        cfg, reply = self.shared.cfg, self.reply
        if onset is not None and reply.first_audio_at is not None and not reply.paused:
            reply.barge_in_s = self.shared.clock() - onset  # its audio stops now (cut or paused below)
            self.shared.observer.barge_in(reply.barge_in_s)
        if not cfg.resume_false_interruption or says_something(partial, cfg.backchannel_words):
            await self.interrupt(send_done=True, reason="turn_detected")
        elif not self.reply.paused:
            self.reply.pause()
            if (ears := self.ears()) is not None and self.client_pauses:
                ears.stop_playback(hold=True)  # the client stops playing it and keeps what it has
            await self.shared.emit(ReplyPaused(self.reply))

    async def resume(self) -> None:
        """The speech that paused the reply was no turn: it goes on where it paused."""
        if self.paused:
            reply = self.reply
            if (ears := self.ears()) is not None and self.client_pauses:
                ears.resume_playback()  # what the client held plays first
            await self.shared.emit(ReplyResumed(reply))  # the wire sends what it held before any more comes
            reply.resume()

    def _remember(self, reply: Reply) -> None:
        """History and TTS context keep what was actually said (and its generated codes)."""
        if reply.remembered or reply.messages is None or not reply.record:
            return
        reply.remembered = True
        history, said = self.shared.history, reply.transcript
        calls = [item for item in map(history.call, (c.call_id for c in reply.calls)) if item is not None]
        if not (said or (not calls and history.last is not None and history.last.role == "user")):
            return
        cut = reply.status == CANCELLED and reply.played is not None
        text = reply.said if cut else said  # all it sent, then cut to what was heard
        item = Item("assistant", text, id=reply.item_id, audio=bool(reply.spoken), clauses=list(reply.spoken),
                    audio_samples=reply.samples)
        if reply.codes and text:
            item.segment = Segment(BOT_SPEAKER, text, np.concatenate(reply.codes))
            self.shared.context.add(item.segment)
        history.add(item, before=calls[0].id if calls else None)  # what it said, then its calls
        if cut and item.audio:
            history.truncate(item, 1000 * min(reply.played, reply.samples) / REPLY_RATE)  # what was heard

    async def _done(self, reply: Reply) -> None:
        """The reply ended; the turn's response ends with it unless tool results are awaited."""
        reply.done_sent = True
        calls = [item for item in map(self.shared.history.call, (c.call_id for c in reply.calls)) if item is not None]
        await self.shared.emit(ReplyDone(reply, reply.transcript, calls))
        if reply.turn <= self.done_turn:
            return  # the turn's response has ended already
        interrupted = reply.status == CANCELLED
        if not interrupted and self.tools.awaiting:
            self._open_turn = reply.turn  # it goes on once the tool results are in
            return
        await self._turn_done(reply.turn, interrupted, None if interrupted else reply.marks)

    async def _turn_done(self, turn: int, interrupted: bool, timings: dict | None = None) -> None:
        self.done_turn, self._open_turn = turn, None
        await self.shared.emit(TurnDone(turn, interrupted, timings))

    # ------------------------------------------------------------------ tool calls
    async def tool_result(self, call_id: str, output: str, then: str | None) -> Item:
        item = self.tools.answer(call_id, output, then)
        if self.tools.follow_up is not None:
            await self._follow()
        return item

    async def _follow(self, finishing: Reply | None = None) -> None:
        """What follows settled calls, once no other reply is running (a filler plays out first)."""
        if self.running and self.reply is not finishing:
            return
        up, self.tools.follow_up = self.tools.follow_up, None
        now = self.shared.clock()
        if up.then == "respond":
            await self.start(now, up.overrides)
        elif up.then == "close":
            await self.start(now, {}, answers="")
        elif up.then == "timeout":
            await self.start(now, up.overrides, script=self.shared.cfg.tool_timeout_reply)

    async def cancel_calls(self) -> None:
        """The user spoke over pending calls (or their reply was cancelled): not waited for any more."""
        for p in self.tools.cancel_all():
            await self.shared.emit(ToolCancelled(p.call, p.turn, "cancelled"))
            if self._open_turn == p.turn and not self.tools.awaiting and not self.running:
                await self._turn_done(p.turn, interrupted=True)  # nothing plays: the waiting response ends here

    async def check_calls(self) -> None:
        """Calls past their time limit end (a reply says so); a filler is said once while waiting."""
        ended, filler = self.tools.due(self.running)
        for p in ended:
            await self.shared.emit(ToolCancelled(p.call, p.turn, "timeout"))
        if ended:
            await self._follow()
        elif filler is not None:
            await self.start(self.shared.clock(), {}, script=self.shared.agent.tool_filler, record=False)

    # ------------------------------------------------------------------ ReplyHost
    def tts_context(self) -> list[Segment]:
        return list(self.shared.context.segments)

    def reply_voice(self, reply: Reply) -> Voice | None:
        """The session's voice now (a change mid-reply takes effect at the next clause), unless the
        reply chose its own."""
        if "voice" in reply.overrides or "voice_reference" in reply.overrides:
            return reply.settings.tts_voice()
        return self.shared.agent.tts_voice()

    async def reply_text(self, reply: Reply, delta: str) -> None:
        await self.shared.emit(ReplyText(reply, delta))

    async def reply_audio(self, reply: Reply, pcm: np.ndarray, seq: int) -> None:
        if reply.turn != self.seq_turn:
            self.seq_turn, self._seq = reply.turn, 0
        if self.in_flight is None or self.in_flight.item_id != reply.item_id:
            self.in_flight = InFlight(reply.turn, reply.item_id)
        self.in_flight.sent.append((self._seq, reply.samples + len(pcm)))
        await self.shared.emit(ReplyAudio(reply, pcm, self._seq))
        self._seq += 1
        if (ears := self.ears()) is not None:
            ears.reference(pcm)

    async def reply_error(self, reply: Reply, code: str, message: str) -> None:
        await self.shared.error(code, message)

    async def reply_ended(self, reply: Reply) -> None:
        self._remember(reply)
        await self._done(reply)
        if self.tools.follow_up is not None:
            await self._follow(finishing=reply)

    async def reply_tool_call(self, reply: Reply, call: ToolCall) -> None:
        """The LLM called a tool: the client is asked to run it; the call joins the history now."""
        item = self.tools.ask(call, reply.turn, reply.id, reply.overrides)
        self.wake.set()  # its filler and timeout clocks start: the receive loop must look again
        await self.shared.emit(ToolCallAsked(reply, call, item, self.shared.history.previous_id(item)))
