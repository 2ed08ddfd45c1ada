"""The ``session:`` section of serve_config*.yaml, read as two things: a session's settings
(:class:`SessionConfig`: the server's, and what a client may choose for its own session;
docs/protocol.md, "Session limits", "Turn taking", "Barge-in") and what one gateway replica
allows whoever connects (:class:`ReplicaLimits`).

Both are validated on construction; the gateway builds them once from the yaml (``read_session_section``)
and each connection gets the settings, or a copy with the client's options
(``dataclasses.replace`` validates again). What the metrics hear is not a setting: it is the
conversation's observer (pipeline/conversation/observer.py).
"""
from __future__ import annotations

from dataclasses import dataclass, fields


@dataclass(frozen=True)
class VADSettings:
    threshold: float = 0.5  # a window at or above this probability is speech
    min_speech_ms: float = 64  # speech.started once speech has lasted this long
    min_silence_ms: float = 200  # speech.stopped once silence (p < threshold - 0.15) has lasted this long
    # Under background voices (babble, a television), a window this much quieter than the caller
    # is silence (pipeline/conversation/ears/foreground.py); 0: off.
    foreground_db: float = 0.0

    def __post_init__(self) -> None:
        if not 0 < self.threshold < 1:
            raise ValueError(f"vad_threshold must be in (0, 1), got {self.threshold!r}")
        for name in ("min_speech_ms", "min_silence_ms", "foreground_db"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"vad_{name} must be >= 0, got {getattr(self, name)!r}")

    @property
    def off_threshold(self) -> float:
        """Hysteresis: speech goes on until the probability falls below this (Silero's own rule)."""
        return max(0.01, self.threshold - 0.15)


TURN_DETECTION = ("vad", "manual")
NOISE_REDUCTION = ("webrtc", "rnnoise", "deepfilter")  # pipeline/conversation/ears/suppression.py
BARGE_IN = ("vad", "words", "vad+words", "off")


@dataclass
class TurnTaking:
    """When a user turn starts and ends (docs/protocol.md, "Turn taking"; docs/turn-taking.md)."""

    # "vad": hands-free: the VAD opens a spoken turn at speech (with vad_preroll_ms before it), and
    # a pause ends it once Smart Turn calls the turn complete, or after eot_max_silence_ms of
    # silence; turn.end works too. "manual": every audio frame belongs to a turn, which ends on
    # turn.end (or STT endpointing, or max_turn_s).
    turn_detection: str = "vad"
    vad_threshold: float = 0.5  # Silero speech probability of a 32 ms window that counts as speech
    vad_min_speech_ms: float = 64  # speech.started after this much speech
    vad_min_silence_ms: float = 200  # speech.stopped after this much silence; Smart Turn runs then
    # Under background voices (babble, a television), a window this much quieter than the caller is
    # silence, so a turn can end (10 is what docs/turn-taking.md measured; off until what it does to
    # load.turn_taking's end of speech is understood).
    vad_foreground_db: float = 0.0
    vad_preroll_ms: float = 300  # a VAD-opened turn starts this long before the detected onset
    eot_threshold: float = 0.5  # Smart Turn probability at or above which a pause ends the turn
    eot_max_silence_ms: float = 1500  # a pause this long ends the turn whatever Smart Turn said
    vad_events: bool = True  # send speech.started / speech.stopped to the client
    # Hands-free: once the user has been silent preemptive_silence_ms (at most vad_min_silence_ms),
    # the reply starts on the transcript so far (the LLM, then its first clause through the TTS),
    # held back while the pause grows and Smart Turn decides; the turn's reply takes it if the turn
    # ends there with that same prompt (pipeline/conversation/speculation.py).
    preemptive_generation: bool = True
    preemptive_silence_ms: float = 100
    # The bot's reply, as sent, is cancelled out of the microphone audio the VAD judges (echo.py).
    echo_cancellation: bool = True
    # A noise suppressor between the echo canceller and the VAD, per session (suppression.py;
    # docs/turn-taking.md, "Noise"): one of NOISE_REDUCTION, or None. The recogniser hears raw audio.
    noise_reduction: str | None = None

    def _check_turn_taking(self) -> None:
        if self.noise_reduction is not None and self.noise_reduction not in NOISE_REDUCTION:
            raise ValueError(f"SessionConfig.noise_reduction must be one of {NOISE_REDUCTION} or null, "
                             f"got {self.noise_reduction!r}")
        if self.turn_detection not in TURN_DETECTION:
            raise ValueError(f"SessionConfig.turn_detection must be one of {TURN_DETECTION}, got {self.turn_detection!r}")
        self.vad_settings  # validates the VAD's threshold and durations
        if not self.preemptive_silence_ms >= 0:
            raise ValueError(f"SessionConfig.preemptive_silence_ms must be >= 0, got {self.preemptive_silence_ms!r}")
        if not self.vad_preroll_ms >= 0:
            raise ValueError(f"SessionConfig.vad_preroll_ms must be >= 0, got {self.vad_preroll_ms!r}")
        if not 0 <= self.eot_threshold <= 1:
            raise ValueError(f"SessionConfig.eot_threshold must be in [0, 1], got {self.eot_threshold!r}")
        if not self.eot_max_silence_ms >= self.vad_min_silence_ms:
            raise ValueError(f"SessionConfig.eot_max_silence_ms ({self.eot_max_silence_ms!r}) must be >= "
                             f"vad_min_silence_ms ({self.vad_min_silence_ms!r})")

    @property
    def vad_settings(self) -> VADSettings:
        return VADSettings(self.vad_threshold, self.vad_min_speech_ms, self.vad_min_silence_ms, self.vad_foreground_db)


@dataclass
class BargeIn:
    """User speech while a reply plays (docs/protocol.md, "Barge-in")."""

    # "vad": once the VAD has heard barge_in_min_speech_ms of speech; "words": once the recogniser
    # hears words (a non-empty partial) in audio louder than barge_in_min_rms; "vad+words": whichever
    # comes first; "off". true is read as "vad", false as "off". Speech interrupts from the reply's
    # first chunk: the echo canceller tells the user from the reply's own echo (echo.py), and words
    # heard while the microphone may carry the echo interrupt only with VAD speech in the cancelled audio.
    barge_in: str = "vad"
    barge_in_min_speech_ms: float = 64  # two 32 ms VAD windows: interrupted at speech.started (docs/turn-taking.md)
    # Speech over a reply pauses it instead of ending it until the speech proves a turn: a word that
    # is not a backchannel (partial or final transcript) ends it, as without this; speech that ends
    # with nothing but backchannel words (or none) is no turn, and the reply resumes where it paused.
    resume_false_interruption: bool = False
    backchannel_words: tuple[str, ...] = ("mm", "mmm", "mhm", "mm-hm", "mm-hmm", "hm", "hmm", "uh-huh", "uh", "um",
                                          "ah", "oh", "yeah", "yep", "yes", "ok", "okay", "right", "sure", "ha", "haha",
                                          "hahaha", "heh", "hehe")
    # Speech over a paused reply that stops within this many ms (a backchannel's length) ends its turn
    # at the VAD's speech.stopped, not after Smart Turn or eot_max_silence_ms: its words decide at once
    # whether the reply resumes (0: no such shortcut; 800 by load.backchannels, docs/turn-taking.md).
    backchannel_max_ms: float = 800
    barge_in_min_rms: float = 0.01  # of int16 full scale; quieter audio never interrupts by words
    # No interruption in the reply's first barge_in_grace_s of audio (0: none; was 0.5 s before the
    # echo canceller's check made it unneeded; kept for clients that want one).
    barge_in_grace_s: float = 0.0

    def _check_barge_in(self) -> None:
        if isinstance(self.barge_in, bool):  # the yaml's and a client's true / false
            self.barge_in = "vad" if self.barge_in else "off"
        if self.barge_in not in BARGE_IN:
            raise ValueError(f"SessionConfig.barge_in must be one of {BARGE_IN} or a bool, got {self.barge_in!r}")
        for name in ("barge_in_min_speech_ms", "barge_in_grace_s", "barge_in_min_rms", "backchannel_max_ms"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"SessionConfig.{name} must be >= 0, got {getattr(self, name)!r}")


@dataclass
class Replying:
    """How a reply is made and sent, and what it remembers."""

    # Audio may lead real time by at most this much (None: send as fast as it is made).
    pace_lead_s: float | None = 0.3
    clause_max_words: int = 12
    # CSM context: the last N turns with audio (user audio encoded once, bot codes as generated).
    context_turns: int = 6
    # The conversation history a session keeps (docs/protocol.md, "Session limits"): past this many
    # characters (messages' text, calls' names and arguments; a running total) the oldest whole user
    # turns go, with the replies, calls and outputs after them; the latest user turn always stays.
    # The whole history goes with every LLM call, whose prompt keeps only the LLM's token budget
    # (history_tokens: 1024 tokens, some 4000 characters, by default; at most max_context_tokens):
    # this bounds what a long session sends and costs, with room to spare for larger budgets.
    max_history_chars: int = 64_000
    # Tool calls (docs/agents.md): a call without a result this long ends, and the reply says so.
    tool_timeout_s: float = 30.0
    tool_timeout_reply: str = "Sorry, I could not get that answer."

    def _check_replying(self) -> None:
        if not self.tool_timeout_s > 0:
            raise ValueError(f"SessionConfig.tool_timeout_s must be > 0, got {self.tool_timeout_s!r}")
        if isinstance(self.max_history_chars, bool) or not isinstance(self.max_history_chars, int) \
                or self.max_history_chars <= 0:
            raise ValueError(f"SessionConfig.max_history_chars must be an integer > 0, "
                             f"got {self.max_history_chars!r}")


@dataclass
class SessionLimits:
    """What one session may cost (docs/protocol.md, "Session limits")."""

    # No frame either way for this long closes the session (idle_timeout, close 1000).
    idle_timeout_s: float = 300.0
    # A spoken turn ends (turn_too_long, then its transcript) once its recognised audio reaches this
    # length, or this long after it took its STT slot: bounds the buffered audio and the slot's hold.
    max_turn_s: float = 60.0
    # Microphone audio faster than max_audio_rate times real time, sustained, is dropped and the
    # client told audio_too_fast (once per episode); audio_burst_s of it may come at once (a
    # recorded turn sent whole), pipeline/conversation/allowance.py.
    max_audio_rate: float = 2.0
    audio_burst_s: float = 60.0
    # Replies a client asks for (typed turns, Realtime response.create): at most this many a minute,
    # sustained, replies_burst at once; one over gets rate_limited and is not started (each runs
    # the LLM, and a forced tool call builds its grammar). Spoken turns are bounded by the audio.
    max_replies_per_minute: int = 60
    replies_burst: int = 10
    # A turn refused an STT slot tries again on a later audio frame, no sooner than this after.
    slot_retry_s: float = 1.0
    # An engine call, or the next item of an engine stream, that takes longer fails with
    # engine_unavailable (a dead or unreachable replica is never heard as silence).
    engine_timeout_s: float = 1.5

    def _check_limits(self) -> None:
        for name in ("idle_timeout_s", "max_turn_s", "engine_timeout_s", "max_audio_rate", "audio_burst_s",
                     "max_replies_per_minute", "replies_burst"):
            if not getattr(self, name) > 0:
                raise ValueError(f"SessionConfig.{name} must be > 0, got {getattr(self, name)!r}")
        if not self.slot_retry_s >= 0:
            raise ValueError(f"SessionConfig.slot_retry_s must be >= 0, got {self.slot_retry_s!r}")


@dataclass
class SessionConfig(SessionLimits, Replying, BargeIn, TurnTaking):
    """A session's settings, one concern a group (:class:`TurnTaking`, :class:`BargeIn`,
    :class:`Replying`, :class:`SessionLimits`); each key is a field of its own, so every key the
    serve configs' ``session:`` section takes is a keyword here."""

    def __post_init__(self) -> None:
        self._check_turn_taking()
        self._check_barge_in()
        self._check_replying()
        self._check_limits()

    @property
    def uses_vad(self) -> bool:
        return self.turn_detection == "vad" or "vad" in self.barge_in or self.vad_events


@dataclass(frozen=True)
class ReplicaLimits:
    # Sessions per gateway replica; a connection over the cap gets server_busy (close 1013).
    max_sessions: int = 64
    # A v1 session whose connection dropped (or whose gateway replica drained) may be resumed this
    # long after it was last alive, with the resume token of its session.ready (pipeline/resume/tokens.py,
    # docs/protocol.md "Resume"); 0: sessions are not resumable.
    resume_window_s: float = 30.0
    # Per client address (pipeline/door/client_limits.py), checked before the WebSocket is accepted:
    # sessions it may hold at once (too_many_sessions, HTTP 429) and handshakes a minute
    # (too_many_handshakes, HTTP 429; ticket requests count too).
    max_sessions_per_client: int = 16
    handshakes_per_minute: int = 120

    def __post_init__(self) -> None:
        for name in ("max_sessions", "max_sessions_per_client", "handshakes_per_minute"):
            if not getattr(self, name) > 0:
                raise ValueError(f"ReplicaLimits.{name} must be > 0, got {getattr(self, name)!r}")
        if not self.resume_window_s >= 0:
            raise ValueError(f"ReplicaLimits.resume_window_s must be >= 0, got {self.resume_window_s!r}")


SETTING_NAMES = frozenset(f.name for f in fields(SessionConfig))
LIMIT_NAMES = frozenset(f.name for f in fields(ReplicaLimits))


def read_session_section(section: dict) -> tuple[SessionConfig, ReplicaLimits]:
    """serve_config's ``session:`` -> (the session settings, the replica's limits); an unknown
    name or a bad value raises ValueError."""
    unknown = set(section) - SETTING_NAMES - LIMIT_NAMES
    if unknown:
        raise ValueError(f"unknown session settings {sorted(unknown)}; known: {sorted(SETTING_NAMES | LIMIT_NAMES)}")
    return (SessionConfig(**{k: v for k, v in section.items() if k in SETTING_NAMES}),
            ReplicaLimits(**{k: v for k, v in section.items() if k in LIMIT_NAMES}))
