"""Turn-taking: when the user speaks, and when their turn is over.

A :class:`TurnTaker` owns a conversation's ears (echo cancellation and VAD), its recogniser slot
(``pipeline/conversation/ears/hearing.py``), Smart Turn and the audio allowance. It hears each microphone frame and
yields what it decided, in order: speech long enough to barge in, words heard, a lull, a turn
over. It knows nothing of replies: the conversation acts on each decision before the next is made
(a turn the frame ended is concluded before the rest of the frame opens the next one).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import AsyncIterator, Awaitable, Callable

import numpy as np

from pipeline.conversation.allowance import Allowance
from pipeline.audio_constants import USER_RATE
from pipeline.conversation.events import Emit, SpeechStarted, SpeechStopped
from pipeline.engines import Backends, EngineUnavailable
from pipeline.errors import E_AUDIO_TOO_FAST, E_ENGINE_UNAVAILABLE, E_TURN_TOO_LONG
from pipeline.conversation.ears.hearing import Recogniser, UserTurn
from pipeline.conversation.ears.listening import Listener
from pipeline.session_config import SessionConfig
from pipeline.conversation.ears.vad import VADEvent

EOT_RECHECK_MS = 100  # Smart Turn runs again after this much more silence in a pause (~25 ms of one core)
SERVER_ENDS = ("smart_turn", "silence", "endpoint", "max_turn", "short")  # what ends a turn hands-free


@dataclass(frozen=True)
class SpeechOver:
    """The VAD has heard speech long enough to barge in (``barge_in_min_speech_ms``)."""


@dataclass(frozen=True)
class Words:
    """The recogniser heard words of the open turn; ``may_barge_in``: loud enough, and not possibly
    the reply's own echo."""

    delta: str
    text: str  # the turn's partial transcript so far
    may_barge_in: bool


@dataclass(frozen=True)
class Lull:
    """Hands-free, the user has been silent ``preemptive_silence_ms``: the turn may be ending (a
    reply may start ahead of its end)."""


@dataclass(frozen=True)
class SpeakingOn:
    """Speech, or again after a lull or a pause: the turn goes on."""


@dataclass(frozen=True)
class TurnOver:
    by: str  # smart_turn, silence, endpoint, max_turn or short (SpeechEnded's)


@dataclass(frozen=True)
class SpeechEnded:
    """Hands-free, the VAD's speech.stopped: ``speech_ms`` of the turn so far were speech (from its
    first onset). Short speech over a paused reply ends its turn at once (``backchannel_max_ms``)."""

    speech_ms: float


@dataclass(frozen=True)
class Transcript:
    """A spoken turn, concluded: its transcript, word times and audio (None: none was kept)."""

    text: str
    words: list[dict] | None
    audio: np.ndarray | None


Decision = SpeechOver | Words | Lull | SpeakingOn | TurnOver | SpeechEnded


class TurnTaker:
    def __init__(self, backends: Backends, stream_id: str, cfg_now: Callable[[], SessionConfig],
                 clock: Callable[[], float], emit: Emit, error: Callable[[str, str], Awaitable[None]],
                 smart_turn=None, observe_smart_turn: Callable[[float], None] = lambda s: None,
                 observe_stt_final: Callable[[float], None] = lambda s: None,
                 language_now: Callable[[], str | None] = lambda: None):
        self.cfg_now, self.clock, self.emit, self.error = cfg_now, clock, emit, error
        cfg = cfg_now()
        self.recogniser = Recogniser(backends, stream_id, cfg_now, clock, error, language_now)
        self.smart_turn = smart_turn
        self.observe_smart_turn, self.observe_stt_final = observe_smart_turn, observe_stt_final
        self.ears: Listener | None = None
        self.configure(cfg)
        self.allowance = Allowance(cfg.max_audio_rate, cfg.audio_burst_s, clock)  # audio seconds
        self.ended_by_server = False  # hands-free: the last spoken turn was ended by the server, no speech since
        self.eot_probabilities: list[float] = []  # Smart Turn's last verdicts (at most 100), for tests and tools
        self.audio_s = 0.0  # user audio heard since the last turn ended
        self.speech_started_at: float | None = None  # on the clock: the last speech onset the VAD heard
        self.speech_ended_at: float | None = None  # and the last speech end

    @property
    def user_turn(self) -> UserTurn:
        """The spoken turn being heard (or the next one's id, before it starts)."""
        return self.recogniser.turn

    def configure(self, cfg: SessionConfig) -> None:
        """Ears when any setting uses the VAD; Smart Turn for hands-free turns."""
        if cfg.uses_vad and self.ears is None:
            self.ears = Listener(cfg.vad_settings, cfg.echo_cancellation)
        if self.ears is not None:
            self.ears.vad.settings = cfg.vad_settings
            self.ears.suppress(cfg.noise_reduction)  # made off the event loop
        if self.smart_turn is None and cfg.turn_detection == "vad" and cfg.eot_threshold > 0:
            from pipeline.conversation.ears.smart_turn import shared_model

            self.smart_turn = shared_model()

    # ------------------------------------------------------------------ hearing
    async def hear(self, pcm: np.ndarray) -> AsyncIterator[Decision]:
        """One microphone frame: the ears hear it first (speech events go out); then it goes to the
        open turn, or opens one (any audio in manual mode, speech with its pre-roll hands-free);
        then a pause may end the turn. Audio faster than the allowance is dropped, told once."""
        cfg = self.cfg_now()
        if not await self._paid(len(pcm) / USER_RATE, cfg):
            return
        self.audio_s += len(pcm) / USER_RATE
        if self.ears is None:
            async for decision in self._audio(pcm, cfg):
                yield decision
            return
        events = self.ears.hear(pcm)
        self._time_speech(events)
        if cfg.vad_events:
            for ev in events:
                kind = SpeechStarted if ev.kind == "speech.started" else SpeechStopped
                await self.emit(kind(1000 * ev.sample / USER_RATE, self.user_turn.item_id))
        if "vad" in cfg.barge_in and self.ears.vad.speech_ms >= cfg.barge_in_min_speech_ms:
            yield SpeechOver()
        if cfg.turn_detection == "manual" or self.user_turn.open:
            turn_audio = pcm
        else:
            onset = next((ev.sample for ev in events if ev.kind == "speech.started"), None)
            preroll = int(cfg.vad_preroll_ms * USER_RATE / 1000)
            # speech goes on after a turn ended mid-speech (turn.end, max_turn_s): it opens the next
            turn_audio = self.ears.since(onset - preroll) if onset is not None else pcm if self.ears.speaking else None
        if turn_audio is not None:
            async for decision in self._audio(turn_audio, cfg):
                yield decision
        if cfg.turn_detection == "vad" and self.user_turn.open:
            async for decision in self._pause(events, cfg):
                yield decision

    def _time_speech(self, events: list[VADEvent]) -> None:
        """When the speech the VAD heard began and ended, on the clock: the frame's last sample
        arrived now, and each event's sample that many samples of the client's audio before it."""
        now = self.clock()
        for ev in events:
            at = now - (self.ears.position - ev.sample) / USER_RATE
            if ev.kind == "speech.started":
                self.speech_started_at = at
            else:
                self.speech_ended_at = at

    async def _paid(self, seconds: float, cfg: SessionConfig) -> bool:
        if self.allowance.take(seconds):
            return True
        if not self.allowance.told:
            self.allowance.told = True
            await self.error(E_AUDIO_TOO_FAST, f"microphone audio is arriving faster than {cfg.max_audio_rate:g}x "
                                               "real time; frames are dropped until it slows down")
        return False

    async def _audio(self, pcm: np.ndarray, cfg: SessionConfig) -> AsyncIterator[Decision]:
        """Audio of the open spoken turn, or the first of a new one. The frame that brings a turn to
        max_turn_s ends it there; the rest of that frame starts the next turn."""
        max_samples = max(1, int(cfg.max_turn_s * USER_RATE))
        while pcm.size:
            if not self.user_turn.open:
                self.ended_by_server = False
                await self.recogniser.begin()
            elif not self.user_turn.holds_slot:
                await self.recogniser.retry()
            if not self.user_turn.holds_slot:
                return  # a refused turn: its audio is dropped
            room = max_samples - self.user_turn.samples
            for ev in await self.recogniser.push(pcm[:room]):
                if ev["kind"] == "partial" and ev["text"]:
                    self.user_turn.partial += ev["text"]
                    yield Words(ev["text"], self.user_turn.partial, self._may_barge_in_by_words(cfg))
                elif ev["kind"] == "endpoint":
                    yield TurnOver("endpoint")
                    break
            pcm = pcm[room:]
            if self.user_turn.open and self.user_turn.samples >= max_samples:
                yield TurnOver("max_turn")

    def _may_barge_in_by_words(self, cfg: SessionConfig) -> bool:
        """Words from loud enough audio, unless the microphone may carry the reply's echo (the
        recogniser hears the raw audio) and the VAD, judging the echo-cancelled audio, hears none."""
        if not ("words" in cfg.barge_in and self.user_turn.loud and self.user_turn.partial.strip()):
            return False
        echo = self.ears.echo if self.ears is not None else None
        return echo is None or not echo.use_cancelled or self.ears.speaking

    async def _pause(self, events: list[VADEvent], cfg: SessionConfig) -> AsyncIterator[Decision]:
        """Hands-free end of turn: from speech.stopped, Smart Turn judges the turn's audio, and again
        each ``EOT_RECHECK_MS`` of silence more (its verdict on a finished sentence often rises as
        the silence after it grows); complete ends the turn then, and eot_max_silence_ms of silence
        ends it whatever the verdicts. Speech again keeps it open. A lull (``preemptive_silence_ms``
        of silence, at most the VAD's) comes first, once per pause. With ``eot_threshold`` 0 every
        pause ends the turn (no model call)."""
        heard = self.user_turn
        silence_ms = self.ears.vad.silence_ms
        lull_ms = min(cfg.preemptive_silence_ms, cfg.vad_min_silence_ms)
        if self.ears.speaking and silence_ms < lull_ms:  # speech, or a gap within it
            heard.eot_deadline = heard.eot_check_at_ms = None
            heard.lull = False
            yield SpeakingOn()
            return
        if not heard.lull and silence_ms >= lull_ms:
            heard.lull = True
            yield Lull()
        if any(ev.kind == "speech.stopped" for ev in events):  # Smart Turn judges the turn from here
            heard.eot_deadline = self.clock() + max(0.0, (cfg.eot_max_silence_ms - silence_ms) / 1000)
            heard.eot_check_at_ms = silence_ms
            yield SpeechEnded(1000 * heard.samples / USER_RATE - cfg.vad_preroll_ms - silence_ms)
            if heard is not self.user_turn:
                return  # it ended the turn
        if heard.eot_check_at_ms is not None and silence_ms >= heard.eot_check_at_ms:
            heard.eot_check_at_ms = silence_ms + EOT_RECHECK_MS
            if await self._complete(heard, cfg) and not self.ears.speaking:
                yield TurnOver("smart_turn")
                return
        if heard.eot_deadline is not None and self.ears.vad.silence_ms >= cfg.eot_max_silence_ms:
            yield TurnOver("silence")

    async def _complete(self, heard: UserTurn, cfg: SessionConfig) -> bool:
        if cfg.eot_threshold <= 0:
            return True
        started = self.clock()
        p = await self.smart_turn.probability_async(heard.joined_audio())
        self.observe_smart_turn(self.clock() - started)
        self.eot_probabilities.append(p)
        del self.eot_probabilities[:-100]
        return p >= cfg.eot_threshold

    async def too_long_error(self) -> None:
        await self.error(E_TURN_TOO_LONG, f"a spoken turn lasts at most {self.cfg_now().max_turn_s:g} s; "
                                          "it ends here as if turn.end had arrived")

    # ------------------------------------------------------------------ ending turns
    def ended_already(self) -> bool:
        """The client ends a turn that the server ended already, with no speech since: not twice
        (it is no new, empty turn). True once."""
        if self.ended_by_server and not self.user_turn.open:
            self.ended_by_server = False
            return True
        return False

    def speech_end(self, by: str, ended_at: float) -> float:
        """When the speech of a turn that ``by`` ended at ``ended_at`` ended: where a pause ended
        it, at the VAD's speech end; where the client (turn.end, commit) or a limit did, then."""
        if by in ("smart_turn", "silence", "short") and self.speech_ended_at is not None:
            return min(self.speech_ended_at, ended_at)
        return ended_at

    async def conclude(self, by: str, finished: tuple[str, list[dict]] | None = None,
                       speech_end: float | None = None) -> Transcript | None:
        """The spoken turn is over: its transcript (``finished``: already had from a peek in this
        frame), with the slot given back. None when nothing was heard (its slot was refused) or the
        recogniser failed (the client is told): the turn is dropped, and no number is used.
        ``speech_end``: when its speech ended (the final transcript's latency is counted from it)."""
        heard = self.user_turn
        if heard.open and not heard.holds_slot:
            self.recogniser.drop()
            return None
        if finished is not None:
            self.recogniser.let_go()  # its transcript is known: the stream closes in the background
        elif heard.open:
            try:
                finished = await self.recogniser.finish()  # gives the slot back
            except EngineUnavailable as exc:
                self.recogniser.drop()
                await self.error(E_ENGINE_UNAVAILABLE, f"the recogniser did not finish this turn ({exc}); "
                                 "its audio is lost (the session stays open; speak again)")
                return None
        else:
            finished = ("", None)
        self.recogniser.drop()
        self.ended_by_server = self.cfg_now().turn_detection == "vad" and by in SERVER_ENDS
        text, words = finished
        if speech_end is not None:
            self.observe_stt_final(self.clock() - speech_end)
        return Transcript(text, words, heard.joined_audio() if heard.audio else None)

    def take_audio_s(self) -> float:
        seconds, self.audio_s = self.audio_s, 0.0
        return seconds

    def paid_item_audio(self, seconds: float) -> bool:
        """An audio item pays its seconds from the same allowance as the microphone."""
        return self.allowance.take(seconds)

    async def clear(self) -> None:
        """Drop the open turn's audio, giving its slot back."""
        await self.recogniser.release()
        self.recogniser.drop()
        self.audio_s = 0.0

    # ------------------------------------------------------------------ deadlines
    def turn_deadline(self) -> float | None:
        """When the open turn has held its slot for ``max_turn_s``."""
        if self.user_turn.open and self.user_turn.holds_slot:
            return self.user_turn.slot_taken_at + self.cfg_now().max_turn_s
        return None

    def due(self) -> TurnOver | None:
        """A deadline that has passed: a pause's end (silence) or the slot's hold (max_turn)."""
        now = self.clock()
        if self.user_turn.eot_deadline is not None and now >= self.user_turn.eot_deadline:
            return TurnOver("silence")
        at = self.turn_deadline()
        if at is not None and now >= at:
            return TurnOver("max_turn")
        return None
