"""One conversation, whatever the wire: the core that every protocol adapter drives.

A :class:`Conversation` hears the user's audio (16 kHz int16) and typed text, decides when a
user turn ends, answers with a :class:`~pipeline.reply.Reply`, and keeps the history, the TTS
context and the agent's settings. It knows no wire format: what happens goes out through a
:class:`ConversationEvents` (protocol v1's ``pipeline.session.Session`` and the Realtime
protocol's ``pipeline.realtime.session.RealtimeSession`` implement it), so pacing, gap metrics,
barge-in, echo cancellation, Smart Turn and the recogniser's slot rules are the same on both.

Turn flow: audio streams into STT (partials go out as deltas); a user turn ends on the client's
word (v1 ``turn.end``, Realtime ``commit``), the server's turn detection (VAD + Smart Turn),
STT endpointing or the ``max_turn_s`` cap; its transcript goes out, and unless the client asked
to answer only on request, a reply starts. User speech while a reply plays (barge-in), or a new
user turn, cancels the reply, and the history keeps only what was actually said. The TTS gets the
conversation so far as CSM context: user turns' audio encoded once, bot turns' generated codes,
inside a bounded number of segments.

A conversation holds an STT slot only during a spoken turn (``pipeline/hearing.py``). The LLM may
call the session's tools: the client runs them, and the reply goes on with their results
(``pipeline/calls.py`` keeps what is pending; fillers and time limits are the core's deadlines).

Engines fail without taking the conversation with them: every engine call, and every item of an
engine stream, must answer within ``engine_timeout_s`` or fails as :class:`EngineUnavailable`
(so does a replica that died under it); the client gets one ``engine_unavailable`` error and the
conversation goes on. An STT replica that does not know the turn's stream raises
:class:`UnknownStream`: the turn restarts there, replaying its audio so far.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from typing import Any, Callable, Protocol

import numpy as np

from pipeline.agent import DEFAULT_VOICE, AgentSettings
from pipeline.allowance import Allowance
from pipeline.calls import CANCELLED as CALL_CANCELLED, TIMED_OUT, ToolCalls
from pipeline.engines import BOT_SPEAKER, USER_SPEAKER, Backends, EngineUnavailable, Segment, ToolCall, Voice, bounded
from pipeline.errors import E_AUDIO_TOO_FAST, E_ENGINE_UNAVAILABLE, E_ITEM_TOO_LARGE, E_RATE_LIMITED, E_TURN_TOO_LONG
from pipeline.hearing import INPUT_RATE, Recogniser, UserTurn
from pipeline.history import MAX_ITEM_CHARS, SAMPLE_RATE as REPLY_RATE, History, Item, item_chars, new_id
from pipeline.listening import Listener
from pipeline.reply import CANCELLED, Reply
from pipeline.resume import Snapshot
from pipeline.session_config import SessionConfig
from pipeline.speculation import CANCELLED as SPECULATION_CANCELLED, HIT, MISS, Speculation
from pipeline.vad import SAMPLE_RATE as VAD_RATE, VADEvent

log = logging.getLogger(__name__)


class Refusal(Exception):
    """A client's input that the conversation's limits refuse, with nothing changed: the adapter
    tells its client (``code``, ``message``, and the field at fault where the protocol names one)."""

    def __init__(self, code: str, message: str, param: str | None = None):
        super().__init__(message)
        self.code, self.message, self.param = code, message, param


class ConversationEvents(Protocol):
    """What a conversation tells its client, as calls; a protocol adapter turns them into messages."""

    async def speech(self, kind: str, audio_ms: float, item_id: str) -> None: ...  # speech.started / .stopped
    async def transcript_delta(self, turn: int, item_id: str, delta: str, text: str) -> None: ...
    # A user turn ended: ``text`` as recognised or typed, ``item`` its history item (added unless its
    # stripped text is empty); ``words`` with times for spoken turns
    async def turn_ended(self, turn: int, item: Item, text: str, words: list[dict] | None) -> None: ...
    async def reply_started(self, reply: Reply) -> None: ...
    async def reply_text(self, reply: Reply, delta: str) -> None: ...
    async def reply_audio(self, reply: Reply, pcm: np.ndarray, seq: int) -> None: ...
    async def reply_done(self, reply: Reply) -> None: ...  # reply.status says how it ended
    # speech over the reply that may be no turn (resume_false_interruption): it stops sending until
    # the speech ends as a backchannel (resumed where it paused) or as a turn (then done, cancelled)
    async def reply_paused(self, reply: Reply) -> None: ...
    async def reply_resumed(self, reply: Reply) -> None: ...
    async def tool_call(self, reply: Reply, call: ToolCall, item: Item) -> None: ...  # the client runs it
    # a call whose result is no longer wanted: reason "cancelled" (the user spoke) or "timeout"
    async def tool_cancelled(self, call: ToolCall, turn: int, reason: str) -> None: ...
    async def error(self, code: str, message: str) -> None: ...


class Conversation:
    def __init__(self, events: ConversationEvents, backends: Backends, cfg: SessionConfig | None = None,
                 session_id: str | None = None, smart_turn=None, voices: tuple[str, ...] = (DEFAULT_VOICE,),
                 clock: Callable[[], float] = time.monotonic):
        self.id = session_id or new_id("sess")
        self.events = events
        self.backends = backends
        self.cfg = cfg or SessionConfig()
        self.clock = clock  # monotonic seconds (tests drive a fake one)
        self.voices = voices  # the voices a session may choose (configured on the TTS replica)
        self.agent = AgentSettings()
        self.smart_turn = smart_turn
        self.ears: Listener | None = None
        self._hear_with(self.cfg)
        self.recogniser = Recogniser(backends, self.id, lambda: self.cfg, clock, self.error)
        self.turn = 0  # number of the last user turn that ended
        self.reply_on_turn_end = True  # a turn the server ended gets its reply (Realtime: create_response)
        self._ended_by_server = False  # hands-free: the last spoken turn was ended by the server, no speech since
        self.eot_probabilities: list[float] = []  # Smart Turn's last verdicts (at most 100), for tests and tools
        self._max_turn_samples = max(1, int(self.cfg.max_turn_s * INPUT_RATE))
        self._last_activity_at = clock()  # last frame either way (the idle clock)
        self.allowance = Allowance(self.cfg.max_audio_rate, self.cfg.audio_burst_s, clock)  # audio seconds
        self.reply_allowance = Allowance(self.cfg.max_replies_per_minute / 60, self.cfg.replies_burst, clock)
        # Set whenever what a resumed conversation would start from changed (pipeline/keeper.py)
        self.state_changed = asyncio.Event()
        self.history = History(max_chars=self.cfg.max_history_chars, on_change=self._changed)
        self.context: list[Segment] = []  # CSM context, oldest first
        self._encoding: asyncio.Task | None = None  # the last user turn's audio joining the context
        self.reply: Reply | None = None
        self._speculation: Speculation | None = None  # the LLM started at the open turn's last pause
        self.speculations: dict[str, int] = {}  # outcomes so far: hit, miss, cancelled (for tests and tools)
        self.calls = ToolCalls()  # the tool calls this conversation waits on
        self.deadline_changed = asyncio.Event()  # set when next_deadline() moved earlier between frames
        self._after_calls: tuple[str, dict] | None = None  # what follows once they are settled, and its settings
        self.closed = False

    def _changed(self) -> None:
        self.state_changed.set()

    # ------------------------------------------------------------------ resume
    def snapshot(self, in_flight=None) -> Snapshot:
        """What a resumed conversation starts from (pipeline/resume.py); ``in_flight``: the reply
        being sent when the connection ended, as the wire adapter counted its messages."""
        return Snapshot(self.id, self.turn, list(self.history.items), self.agent, list(self.context), in_flight,
                        time.time())

    def restore(self, snap: Snapshot, generation: int, received: tuple[int | None, int | None]) -> None:
        """Continue the conversation ``snap`` was taken of (before anything else happens in this
        one). A reply that was in flight ends at what the client received (``received``: the turn
        and seq of the last audio message it has; (None, None): all that was sent)."""
        self.turn = snap.turn
        for item in snap.items:
            self.history.add(item)
        self.agent = snap.agent
        self.context = list(snap.context)
        # a stream the dropped session left open on the recogniser never collides with this one's
        self.recogniser.stream_id = f"{self.id}.{generation}"
        flight = snap.in_flight
        if flight is None or received == (None, None):
            return
        item = next((i for i in self.history.items if i.id == flight.item_id), None)
        if item is not None and item.audio:
            samples = min(flight.samples_received(*received), item.audio_samples)
            self.history.truncate(item, 1000 * samples / REPLY_RATE)

    @property
    def heard(self) -> UserTurn:
        """The spoken turn being heard (or the next one's id, before it starts)."""
        return self.recogniser.turn

    def _hear_with(self, cfg: SessionConfig) -> None:
        """Ears (echo cancellation + VAD) when any setting uses the VAD; Smart Turn for hands-free turns."""
        if cfg.uses_vad and self.ears is None:
            self.ears = Listener(cfg.vad_settings, cfg.echo_cancellation)
        if self.ears is not None:
            self.ears.vad.settings = cfg.vad_settings
        if self.smart_turn is None and cfg.turn_detection == "vad" and cfg.eot_threshold > 0:
            from pipeline.smart_turn import shared_model

            self.smart_turn = shared_model()

    # ------------------------------------------------------------------ settings
    def configure(self, **changes: Any) -> None:
        """Change turn-taking settings of this session (SessionConfig fields; validated whole)."""
        cfg = dataclasses.replace(self.cfg, **changes)
        self._hear_with(cfg)
        self.cfg = cfg
        self.history.max_chars = cfg.max_history_chars  # applies from the next item added

    def update(self, changes: dict[str, Any]) -> AgentSettings:
        """Apply agent settings (raises pipeline.agent.BadSetting, changing nothing). A new voice
        starts the bot's side of the TTS context afresh: its earlier turns were another voice."""
        agent = self.agent.updated(changes, self.voices)
        if agent.tts_voice() != self.agent.tts_voice():
            self.context = [seg for seg in self.context if seg.speaker != BOT_SPEAKER]
        self.agent = agent
        self._changed()
        return agent

    async def encode_voice_clip(self, pcm_24k: np.ndarray, text: str) -> Segment:
        """A session's own reference clip (int16 24 kHz) -> its context segment (bucketed encode:
        never a new shape on the TTS replica)."""
        codes = await bounded(self.backends.tts_encode(pcm_24k, 24_000), self.cfg.engine_timeout_s)
        return Segment(BOT_SPEAKER, text, codes)

    # ------------------------------------------------------------------ lifecycle
    def touch(self) -> None:
        """Something went either way: the idle clock starts again."""
        self._last_activity_at = self.clock()

    async def close(self) -> None:
        """Cancel everything this conversation started and release an STT slot its open turn holds."""
        if self.closed:
            return
        self.closed = True
        await self._drop_speculation(SPECULATION_CANCELLED)
        await self._interrupt(send_done=False)
        if self._encoding is not None:
            self._encoding.cancel()
        await self.recogniser.release()

    # ------------------------------------------------------------------ input
    async def hear(self, pcm: np.ndarray) -> None:
        """One microphone frame (int16 16 kHz): the ears hear it first (speech events go out, speech
        over a reply barges in); then it goes to the open turn, or opens one (any audio in manual
        mode, speech with its pre-roll in vad mode); then a pause may end the turn. Audio faster
        than the allowance (``max_audio_rate`` times real time, sustained) is dropped, told once."""
        if not self.allowance.take(len(pcm) / INPUT_RATE):
            if not self.allowance.told:
                self.allowance.told = True
                await self.error(E_AUDIO_TOO_FAST, f"microphone audio is arriving faster than "
                                 f"{self.cfg.max_audio_rate:g}x real time; frames are dropped until it slows down")
            return
        if self.ears is None:
            await self._on_audio(pcm)
            return
        events = self.ears.hear(pcm)
        if self.cfg.vad_events:
            for ev in events:
                await self.events.speech(ev.kind, 1000 * ev.sample / VAD_RATE, self.heard.item_id)
        if "vad" in self.cfg.barge_in_mode and self.ears.vad.speech_ms >= self.cfg.barge_in_min_speech_ms:
            if self._reply_interruptible():
                await self._barge_in()
            if self.calls.waiting:  # the user speaks over a pending tool call: it is not waited for any more
                await self._cancel_calls()
        if self.cfg.turn_detection == "manual" or self.heard.open:
            await self._on_audio(pcm)
        else:
            onset = next((ev.sample for ev in events if ev.kind == "speech.started"), None)
            if onset is not None:
                preroll = int(self.cfg.vad_preroll_ms * VAD_RATE / 1000)
                await self._on_audio(self.ears.since(onset - preroll))
            elif self.ears.speaking:  # speech goes on after a turn ended mid-speech (turn.end, max_turn_s)
                await self._on_audio(pcm)
        if self.cfg.turn_detection == "vad" and self.heard.open:
            await self._end_turn_on_pause(events)

    async def end_turn(self, respond: bool = True, overrides: dict[str, Any] | None = None) -> None:
        """The client ended the spoken turn (push-to-talk, commit). Hands-free, one that the server
        already ended, with no speech since, is not ended twice (it is not a new, empty turn)."""
        if self._ended_by_server and not self.heard.open:
            self._ended_by_server = False
            return
        await self._end_turn(respond=respond, overrides=overrides)

    async def user_text(self, text: str, respond: bool = True, overrides: dict[str, Any] | None = None,
                        after: str | None = None) -> Item:
        """A typed user turn. Spoken audio in flight becomes its own turn first."""
        self._pay_for_reply()
        return await self._end_turn(typed_text=text, by="typed", respond=respond, overrides=overrides, after=after)

    async def add_item(self, item: Item, after: str | None = None) -> Item:
        """An item the client adds to the history as it is (no turn, no reply); at most
        MAX_ITEM_CHARS of text, name and arguments (Refusal item_too_large)."""
        if item_chars(item) > MAX_ITEM_CHARS:
            raise Refusal(E_ITEM_TOO_LARGE, f"an item holds at most {MAX_ITEM_CHARS} characters of text, name and "
                                            f"arguments; this one has {item_chars(item)}", "item")
        return self.history.add(item, after)

    async def add_user_audio(self, pcm: np.ndarray, after: str | None = None) -> Item:
        """A user message the client gives as audio (16 kHz int16): recognised whole on a stream of
        its own (a spoken turn may be open beside it) and added to the history; no turn, no reply.
        It pays for its audio as microphone audio does (Refusal audio_too_fast), and is at most
        max_turn_s long (Refusal turn_too_long). Raises EngineUnavailable (no free slot included)
        with nothing added."""
        seconds = len(pcm) / INPUT_RATE
        if seconds > self.cfg.max_turn_s:
            raise Refusal(E_TURN_TOO_LONG, f"an item's audio lasts at most {self.cfg.max_turn_s:g} s (max_turn_s); "
                                           f"this one lasts {seconds:.1f} s", "item.content")
        if not self.allowance.take(seconds):
            raise Refusal(E_AUDIO_TOO_FAST, f"audio is arriving faster than {self.cfg.max_audio_rate:g}x real time "
                                            "(items and microphone together); this item is refused", "item.content")
        text = await self.recogniser.transcribe(pcm, f"{self.id}:item")
        item = self.history.add(Item("user", text.strip(), audio=True), after)
        if item.text and len(pcm):
            self._encode_later(item.text, pcm)
        return item

    async def respond(self, overrides: dict[str, Any] | None = None) -> Reply:
        """Start a reply to the conversation so far (Realtime ``response.create``); the caller
        makes sure none is running. Replies asked for are rate-limited (Refusal rate_limited)."""
        self._pay_for_reply()
        return await self._start_reply(self.clock(), overrides or {})

    def _pay_for_reply(self) -> None:
        """A reply the client asks for (a typed turn, response.create) pays from the reply allowance."""
        if not self.reply_allowance.take(1):
            raise Refusal(E_RATE_LIMITED, f"at most {self.cfg.max_replies_per_minute} replies a minute are asked for "
                                          f"(typed turns and response.create; {self.cfg.replies_burst} at once): this "
                                          "one is refused")

    async def stop_replying(self) -> None:
        """The connection is about to end (a draining replica): the reply being sent ends at the
        chunk it is at, and the history keeps what it said so far."""
        await self._drop_speculation(SPECULATION_CANCELLED)
        await self._interrupt(send_done=True, reason="server_shutdown")

    async def cancel_reply(self) -> bool:
        """Cancel the running reply (the client asked); False if none was running."""
        if self.reply is None or not self.reply.running:
            return False
        await self._interrupt(send_done=True, reason="client_cancelled")
        return True

    async def clear_audio(self) -> None:
        """Drop the open spoken turn's audio (Realtime ``input_audio_buffer.clear``)."""
        await self._drop_speculation(SPECULATION_CANCELLED)
        await self.recogniser.release()
        self.recogniser.drop()

    async def truncate(self, item_id: str, audio_end_ms: float) -> Item:
        """Keep only what the client played of an assistant item (raises UnknownItem / ValueError)."""
        if self.reply is not None and self.reply.item_id == item_id:
            await self._interrupt(send_done=True, reason="client_cancelled")
        item = self.history.get(item_id)
        self.history.truncate(item, audio_end_ms)
        return item

    def delete(self, item_id: str) -> Item:
        item = self.history.delete(item_id)
        if item.segment is not None and item.segment in self.context:
            self.context.remove(item.segment)
        return item

    async def _end_turn_on_pause(self, events: list[VADEvent]) -> None:
        """Hands-free end of turn: at speech.stopped, Smart Turn judges the turn's audio; complete
        ends the turn now, incomplete waits for speech again or eot_max_silence_ms of silence. With
        ``eot_threshold`` 0 every pause ends the turn (no model call)."""
        heard = self.heard
        if self.ears.speaking:
            heard.eot_deadline = None
            await self._drop_speculation(SPECULATION_CANCELLED)  # the user speaks on
            return
        if any(ev.kind == "speech.stopped" for ev in events):
            # preemptive: the turn's transcript as it would end now, and the LLM on it, while Smart Turn decides
            peek = asyncio.create_task(self._peek_and_speculate()) if self._may_speculate() else None
            p = 1.0
            try:
                if self.cfg.eot_threshold > 0:
                    started = self.clock()
                    p = await self.smart_turn.probability_async(heard.joined_audio())
                    if self.cfg.on_smart_turn:
                        self.cfg.on_smart_turn(self.clock() - started)
                    self.eot_probabilities.append(p)
                    del self.eot_probabilities[:-100]
            finally:
                finished = await peek if peek is not None else None
            if p >= self.cfg.eot_threshold and not self.ears.speaking:
                await self._end_turn(by="smart_turn", finished=finished)
                return
            wait_s = (self.cfg.eot_max_silence_ms - self.ears.vad.silence_ms) / 1000
            heard.eot_deadline = self.clock() + max(0.0, wait_s)
        if heard.eot_deadline is not None and self.ears.vad.silence_ms >= self.cfg.eot_max_silence_ms:
            await self._end_turn(by="silence")

    async def _on_audio(self, pcm: np.ndarray) -> None:
        """Audio of the open spoken turn, or the first of a new one. The frame that brings a turn to
        max_turn_s ends it there (turn_too_long); the rest of that frame starts the next turn."""
        while pcm.size:
            if not self.heard.open:
                await self._begin_turn()
            elif not self.heard.holds_slot:
                await self.recogniser.retry()
            if not self.heard.holds_slot:
                return  # a refused turn: its audio is dropped
            room = self._max_turn_samples - self.heard.samples
            await self._recognise(pcm[:room])
            pcm = pcm[room:]
            if self.heard.open and self.heard.samples >= self._max_turn_samples:
                await self._end_long_turn()

    async def _begin_turn(self) -> None:
        self._ended_by_server = False
        await self.recogniser.begin()

    async def _recognise(self, pcm: np.ndarray) -> None:
        """Audio of the open turn to the recogniser; its partials go out (and may barge in by
        words), its endpoint ends the turn."""
        heard = self.heard
        for ev in await self.recogniser.push(pcm):
            if ev["kind"] == "partial" and ev["text"]:
                heard.partial += ev["text"]
                if self._reply_paused() and self._says_something(heard.partial):
                    await self._interrupt(send_done=True, reason="turn_detected")  # words: a turn, not a backchannel
                elif heard.partial.strip() and self._should_barge_in():
                    await self._barge_in()
                await self.events.transcript_delta(self.turn + 1, heard.item_id, ev["text"], heard.partial)
            elif ev["kind"] == "endpoint":
                await self._end_turn(by="endpoint")
                break

    def _should_barge_in(self) -> bool:
        """Barge-in by words: a non-empty partial from loud enough audio, unless the microphone may
        carry the reply's echo (the recogniser hears the raw audio) and the VAD, judging the
        echo-cancelled audio, hears no speech."""
        if not ("words" in self.cfg.barge_in_mode and self.heard.loud and self._reply_interruptible()):
            return False
        echo = self.ears.echo if self.ears is not None else None
        return echo is None or not echo.use_cancelled or self.ears.speaking

    async def _barge_in(self) -> None:
        """The user speaks over the playing reply: it ends; or, with ``resume_false_interruption``,
        while nothing they said so far is more than a backchannel, it pauses until their speech
        ends as a turn (then it ends) or as no turn (then it resumes)."""
        reply = self.reply
        if not self.cfg.resume_false_interruption or self._says_something(self.heard.partial):
            await self._interrupt(send_done=True, reason="turn_detected")
        elif not reply.paused:
            reply.pause()
            if self.ears is not None:
                self.ears.stop_playback()  # the client stops playing it
            await self.events.reply_paused(reply)

    def _reply_paused(self) -> bool:
        return self.reply is not None and self.reply.running and self.reply.paused

    async def _resume_reply(self) -> None:
        """The speech that paused the reply was no turn: it goes on where it paused."""
        if self._reply_paused():
            self.reply.resume()
            await self.events.reply_resumed(self.reply)

    def _says_something(self, text: str) -> bool:
        """Whether ``text`` holds a word that is not a backchannel ("mm-hm", "yeah", ...)."""
        words = [w.strip(".,!?;:'\"-").lower() for w in text.split()]
        return any(w and w not in self.cfg.backchannel_words for w in words)

    def _reply_interruptible(self) -> bool:
        reply = self.reply
        if reply is None or not reply.running:
            return False
        if reply.first_audio_at is None:
            return True  # nothing played yet: the user simply talks on
        return self.clock() - reply.first_audio_at >= self.cfg.barge_in_grace_s

    async def _end_long_turn(self) -> None:
        await self.error(E_TURN_TOO_LONG, f"a spoken turn lasts at most {self.cfg.max_turn_s:g} s; "
                         "it ends here as if turn.end had arrived")
        await self._end_turn(by="max_turn")

    async def _end_turn(self, typed_text: str | None = None, by: str = "turn_end", respond: bool | None = None,
                        overrides: dict[str, Any] | None = None, after: str | None = None,
                        finished: tuple[str, list[dict]] | None = None) -> Item | None:
        """End the current user turn (spoken or typed), add it to the history and, if ``respond``,
        start its reply. ``by``: what ended it (turn_end, typed, smart_turn, silence, endpoint,
        max_turn), for the metrics. ``respond`` None: as ``reply_on_turn_end`` says (a turn the
        server ended). ``finished``: the spoken turn's transcript and words, already had from the
        recogniser (:meth:`Recogniser.peek` in this same frame), so it need not be asked again."""
        ended_at = self.clock()
        if respond is None:
            respond = self.reply_on_turn_end
        heard = self.heard
        if heard.open and not heard.holds_slot:
            self.recogniser.drop()  # refused: nothing was heard, so nothing is sent and no number is used
            if typed_text is None:
                await self._drop_speculation(MISS)
                await self._resume_reply()
                return None
        if finished is not None:
            self.recogniser.let_go()  # its transcript is known: the stream closes in the background
        if typed_text is None and heard.open and self._reply_paused() and finished is None:
            try:
                finished = await self.recogniser.finish()  # gives the slot back
            except EngineUnavailable as exc:
                self.recogniser.drop()
                await self.error(E_ENGINE_UNAVAILABLE, f"the recogniser did not finish this turn ({exc}); "
                                 "its audio is lost (the session stays open; speak again)")
                finished = ("", [])
        if typed_text is None and heard.open and self._reply_paused():
            if not self._says_something(finished[0]):  # a backchannel, or nothing: no turn, no number
                self.recogniser.drop()
                self._ended_by_server = self.cfg.turn_detection == "vad" and by in ("smart_turn", "silence",
                                                                                   "endpoint", "max_turn")
                await self._drop_speculation(MISS)
                await self._resume_reply()
                return None
        if typed_text is not None and self.heard.open:
            await self._end_turn(respond=respond)  # spoken audio in flight becomes its own turn first
        await self._cancel_calls()
        await self._interrupt(send_done=True, reason="turn_detected")
        user_audio, words = None, None
        heard = self.heard
        if typed_text is not None:
            text = typed_text
        elif finished is not None:
            text, words = finished
            user_audio = heard.joined_audio() if heard.audio else None
        elif heard.open:
            try:
                text, words = await self.recogniser.finish()  # gives the slot back
            except EngineUnavailable as exc:
                self.recogniser.drop()  # nothing to answer: no turn number is used
                await self._drop_speculation(MISS)
                await self.error(E_ENGINE_UNAVAILABLE, f"the recogniser did not finish this turn ({exc}); "
                                 "its audio is lost (the session stays open; speak again)")
                return None
            user_audio = heard.joined_audio() if heard.audio else None
        else:
            text = ""
        self.recogniser.drop()
        self._ended_by_server = (self.cfg.turn_detection == "vad" and typed_text is None
                                 and by in ("smart_turn", "silence", "endpoint", "max_turn"))
        self.turn += 1
        self._changed()
        item = Item("user", text.strip(), id=heard.item_id, audio=typed_text is None)
        if item.text:
            self.history.add(item, after)
            if user_audio is not None:  # encoded once, beside the LLM's first tokens, for the TTS context
                self._encode_later(item.text, user_audio)
        await self.events.turn_ended(self.turn, item, text, words)
        if self.cfg.on_turn:
            self.cfg.on_turn()
        if self.cfg.on_turn_end:
            self.cfg.on_turn_end(by)
        if respond:
            await self._start_reply(ended_at, overrides or {}, answers=item.text)
        else:
            await self._drop_speculation(MISS)
        return item

    def _encode_later(self, text: str, pcm: np.ndarray) -> None:
        """Encode a user turn's audio for the TTS context after the encodes before it: one at a time
        per conversation, and cancelling the last (as close() does) cancels those it waits on."""
        before = self._encoding

        async def in_turn() -> None:
            if before is not None:  # gather: this task's cancellation cancels the one it waits on
                await asyncio.gather(before, return_exceptions=True)
            await self._encode_user_turn(text, pcm)

        self._encoding = asyncio.create_task(in_turn())

    async def _encode_user_turn(self, text: str, pcm: np.ndarray) -> None:
        try:
            codes = await bounded(self.backends.tts_encode(pcm), self.cfg.engine_timeout_s)
        except EngineUnavailable as exc:
            log.warning("session %s: encoding user audio: %s", self.id, exc)
            return
        except Exception:  # noqa: BLE001 - context is an improvement, never a failure
            log.exception("session %s: encoding user audio failed", self.id)
            return
        if len(codes):
            self._add_context(Segment(USER_SPEAKER, text, codes))

    def _add_context(self, seg: Segment) -> None:
        self.context.append(seg)
        del self.context[: -self.cfg.context_turns]
        self._changed()

    # ------------------------------------------------------------------ deadlines
    def next_deadline(self) -> float:
        """The monotonic time at which :meth:`check_deadlines` next has work: the open turn's
        ``max_turn_s``, the end of a hands-free pause, or the idle limit. The receive loop waits
        for a frame until then."""
        return min(t for t in (self._idle_deadline(), self._turn_deadline(), self.heard.eot_deadline,
                               self._calls_deadline()) if t is not None)

    async def check_deadlines(self) -> bool:
        """End a spoken turn that has held its slot past ``max_turn_s`` (a client that stopped
        sending mid-turn); return True once nothing went either way for ``idle_timeout_s``."""
        if self.heard.eot_deadline is not None and self.clock() >= self.heard.eot_deadline:
            await self._end_turn(by="silence")  # a hands-free client went quiet after a pause: the turn is over
        turn_at = self._turn_deadline()
        if turn_at is not None and self.clock() >= turn_at:
            await self._end_long_turn()
        await self._check_calls()
        return self.clock() >= self._idle_deadline()

    def _idle_deadline(self) -> float:
        if self.reply is not None and self.reply.running:
            # Waiting for a reply is not idleness (it may queue behind others' TTS): look again later.
            return self.clock() + self.cfg.idle_timeout_s
        return self._last_activity_at + self.cfg.idle_timeout_s

    def _turn_deadline(self) -> float | None:
        if self.heard.open and self.heard.holds_slot:
            return self.heard.slot_taken_at + self.cfg.max_turn_s
        return None

    # ------------------------------------------------------------------ replies
    async def _start_reply(self, ended_at: float, overrides: dict[str, Any], answers: str | None = None,
                           script: str | None = None, record: bool = True) -> Reply:
        """A reply to the history as it is; ``answers``: the user turn it answers ("": an empty
        turn, which gets a reply that ends at once). ``overrides``: agent settings for this reply
        only (checked by the caller). ``script``: a fixed text to say instead of the LLM's;
        ``record``: whether what it says joins the history."""
        settings = self.agent.updated(overrides, self.voices) if overrides else self.agent
        last = self.history.last
        if last is not None and last.kind == "function_call_output" and settings.tool_choice != "none":
            # a reply to tool results may call again, but is not made to: "required" would loop forever
            settings = dataclasses.replace(settings, tool_choice="auto")
        messages = None if answers == "" else settings.messages(self.history.messages())
        llm = await self._take_speculation(messages, settings) if script is None and messages is not None else None
        encoding, self._encoding = self._encoding, None
        reply = self.reply = Reply(self, self.turn, messages, settings, ended_at, encoding, overrides, script, record,
                                   llm=llm)
        await self.events.reply_started(reply)
        reply.start()
        return reply

    # ------------------------------------------------------------------ preemptive generation
    def _may_speculate(self) -> bool:
        return self.cfg.preemptive_generation and self.reply_on_turn_end and not self.calls.waiting

    async def _peek_and_speculate(self) -> tuple[str, list[dict]] | None:
        """The recogniser's transcript of the turn as it would end now (None: not to be had), and
        the LLM started on it."""
        finished = await self.recogniser.peek()
        await self._speculate(finished[0].strip() if finished is not None else "")
        return finished

    async def _speculate(self, text: str) -> None:
        """At a pause of a hands-free turn that will get a reply: start the LLM on the prompt the
        turn would get if it ended with ``text`` (replacing one started at an earlier pause of it).
        Nothing of it is sent unless the turn ends with that same prompt."""
        if not text:
            await self._drop_speculation(SPECULATION_CANCELLED)
            return
        messages = self.agent.messages(self.history.messages() + [{"role": "user", "content": text}])
        options = self._llm_options(self.agent)
        if self._speculation is not None and self._speculation.matches(messages, options):
            return  # the same prompt as at the last pause: keep it
        await self._drop_speculation(SPECULATION_CANCELLED)
        self._speculation = Speculation(self.backends.llm_stream(messages, **options), messages, options,
                                        self.cfg.engine_timeout_s)

    @staticmethod
    def _llm_options(settings: AgentSettings) -> dict:
        return settings.llm_options().overrides()

    async def _take_speculation(self, messages: list[dict], settings: AgentSettings):
        """The speculated LLM stream if it was started on exactly this prompt, else None (and it
        is cancelled)."""
        spec = self._speculation
        if spec is None:
            return None
        if spec.matches(messages, self._llm_options(settings)):
            self._speculation = None
            self._count_speculation(HIT)
            return spec.stream()
        await self._drop_speculation(MISS)
        return None

    async def _drop_speculation(self, outcome: str) -> None:
        spec, self._speculation = self._speculation, None
        if spec is not None:
            await spec.cancel()
            self._count_speculation(outcome)

    def _count_speculation(self, outcome: str) -> None:
        self.speculations[outcome] = self.speculations.get(outcome, 0) + 1
        if self.cfg.on_speculation:
            self.cfg.on_speculation(outcome)

    async def _interrupt(self, send_done: bool, reason: str = "turn_detected") -> None:
        reply, self.reply = self.reply, None
        if reply is None or not reply.running:
            return
        # Once cancelled, the reply task sends nothing more (its next await raises), so the client
        # hears of the interruption at once, not after the engines have let go of its work.
        reply.task.cancel()
        reply.status, reply.reason = CANCELLED, reason
        if self.ears is not None:
            self.ears.stop_playback()  # the client drops what it has not played
        if reason == "turn_detected" or reply.calls:  # the user spoke, or the calls were this reply's
            await self._cancel_calls()
        if send_done and not reply.done_sent:
            reply.done_sent = True
            await self.events.reply_done(reply)
        await asyncio.gather(reply.task, return_exceptions=True)
        self._remember(reply, reply.said)
        if self.cfg.on_interrupt and reason != "server_shutdown":
            self.cfg.on_interrupt()

    def _remember(self, reply: Reply, said: str) -> None:
        """History and TTS context keep what was actually said (and its generated codes)."""
        if reply.remembered or reply.messages is None or not reply.record:
            return
        reply.remembered = True
        calls = [item for item in map(self.history.call, (c.call_id for c in reply.calls)) if item is not None]
        if not (said or (not calls and self.history.last is not None and self.history.last.role == "user")):
            return
        item = Item("assistant", said, id=reply.item_id, audio=bool(reply.spoken), clauses=list(reply.spoken),
                    audio_samples=reply.samples)
        if reply.codes and said:
            item.segment = Segment(BOT_SPEAKER, said, np.concatenate(reply.codes))
            self._add_context(item.segment)
        self.history.add(item, before=calls[0].id if calls else None)  # what it said, then its calls

    # ReplyHost: what a reply asks of its conversation
    def tts_context(self) -> list[Segment]:
        return list(self.context)

    def reply_voice(self, reply: Reply) -> Voice | None:
        """The session's voice now (a change mid-reply takes effect at the next clause), unless the
        reply chose its own."""
        agent = self.agent.updated(reply.overrides, self.voices) if reply.overrides else self.agent
        return agent.tts_voice()

    async def reply_text(self, reply: Reply, delta: str) -> None:
        await self.events.reply_text(reply, delta)

    async def reply_audio(self, reply: Reply, pcm: np.ndarray, seq: int) -> None:
        await self.events.reply_audio(reply, pcm, seq)
        if self.ears is not None:
            self.ears.played(pcm)

    async def reply_error(self, reply: Reply, code: str, message: str) -> None:
        await self.error(code, message)

    async def reply_ended(self, reply: Reply) -> None:
        self._remember(reply, reply.text.strip())
        reply.done_sent = True
        await self.events.reply_done(reply)
        if self._after_calls is not None:
            await self._follow_calls(finishing=reply)

    async def reply_tool_call(self, reply: Reply, call: ToolCall) -> None:
        """The LLM called a tool: the client is asked to run it; the call joins the history now."""
        self.calls.ask(call, reply.turn, reply.id, self.clock(), reply.overrides)
        self.deadline_changed.set()  # its filler and timeout clocks start: the receive loop must look again
        item = self.history.add(Item.call(call.call_id, call.name, call.arguments))
        await self.events.tool_call(reply, call, item)

    # ------------------------------------------------------------------ tool results
    async def tool_result(self, call_id: str, output: str, then: str | None = None) -> Item:
        """The client's result for a call (raises calls.ToolResultError, changing nothing). Once the
        last pending call has its result, ``then`` says what follows: "respond" (a reply that uses
        the results), "close" (nothing more is said: an empty reply ends the turn's response) or
        None (the client asks for a reply itself: Realtime ``response.create``)."""
        pending = self.calls.answer(call_id, output, known=self.history.call(call_id) is not None)
        item = self.history.add(Item.output(call_id, output))
        if pending is not None and not self.calls.waiting and then is not None:
            self._after_calls = (then, pending.overrides)
            await self._follow_calls()
        return item

    @property
    def awaiting_calls(self) -> bool:
        """Tool calls are pending, or their results are in and a reply is about to follow: the
        response of the turn goes on."""
        return self.calls.waiting or self._after_calls is not None

    async def _follow_calls(self, finishing: Reply | None = None) -> None:
        """What follows settled calls, once no other reply is running (a filler plays out first)."""
        if self.reply is not None and self.reply is not finishing and self.reply.running:
            return
        then, overrides = self._after_calls
        self._after_calls = None
        if then == "respond":
            await self._start_reply(self.clock(), overrides)
        elif then == "close":
            await self._start_reply(self.clock(), {}, answers="")
        elif then == "timeout":
            await self._start_reply(self.clock(), overrides, script=self.cfg.tool_timeout_reply)

    async def _cancel_calls(self) -> None:
        """The user spoke over pending calls (or their reply was cancelled): their results are not
        waited for; the history records that they were cancelled."""
        for p in self.calls.end_all(CALL_CANCELLED):
            self.history.add(Item.output(p.call.call_id, "cancelled: the user spoke before the result came"))
            await self.events.tool_cancelled(p.call, p.turn, "cancelled")
        self._after_calls = None

    def _calls_deadline(self) -> float | None:
        oldest = self.calls.oldest()
        if oldest is None:
            return None
        due = oldest + self.cfg.tool_timeout_s
        if self.agent.tool_filler and not self.calls.filler_spoken:
            due = min(due, oldest + self.agent.tool_filler_after_ms / 1000)
        return due

    async def _check_calls(self) -> None:
        """Pending calls past ``tool_timeout_s`` end (the reply says so); past the filler delay, the
        filler is said once while nothing else plays."""
        oldest = self.calls.oldest()
        if oldest is None:
            return
        now = self.clock()
        if now >= oldest + self.cfg.tool_timeout_s:
            overrides: dict = {}
            for p in self.calls.end_all(TIMED_OUT):
                overrides = p.overrides
                self.history.add(Item.output(p.call.call_id, f"error: no result within {self.cfg.tool_timeout_s:g} s"))
                await self.events.tool_cancelled(p.call, p.turn, "timeout")
            self._after_calls = ("timeout", overrides)
            await self._follow_calls()
        elif (self.agent.tool_filler and not self.calls.filler_spoken
              and now >= oldest + self.agent.tool_filler_after_ms / 1000
              and not (self.reply is not None and self.reply.running)):
            self.calls.filler_spoken = True
            await self._start_reply(now, {}, script=self.agent.tool_filler, record=False)

    async def error(self, code: str, message: str) -> None:
        if self.cfg.on_error:
            self.cfg.on_error(code)
        await self.events.error(code, message)


class WireSession:
    """What every wire adapter offers the connection (``pipeline.connection``) and delegates to its
    conversation core: settings, deadlines, errors and closing. An adapter sets ``self.core``."""

    core: Conversation
    resumable = False  # whether its wire lets a dropped connection resume (pipeline/keeper.py)
    leaving: asyncio.Event  # set to make the connection end the session between frames (pipeline/connection.py)
    replaced_by_resume = False

    def replaced(self) -> None:
        """A newer connection resumed this session: this one leaves (the newer one wins)."""
        self.replaced_by_resume = True
        self.leaving.set()

    def in_flight(self):
        """The reply being sent, as the wire counted its audio messages (resumable adapters)."""
        return None

    async def going_away(self, resume_token: str | None, reason: str) -> None:
        """The server stops serving this connection (a draining replica): stop the reply being sent."""
        await self.core.stop_replying()

    @property
    def cfg(self) -> SessionConfig:
        return self.core.cfg

    @property
    def closed(self) -> bool:
        return self.core.closed

    @property
    def deadline_changed(self) -> asyncio.Event:
        return self.core.deadline_changed

    def next_deadline(self) -> float:
        return self.core.next_deadline()

    async def check_deadlines(self) -> bool:
        return await self.core.check_deadlines()

    async def send_error(self, code: str, message: str) -> None:
        await self.core.error(code, message)

    async def close(self) -> None:
        await self.core.close()
