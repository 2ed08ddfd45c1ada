"""A session's ears: echo cancellation, voice activity, and the recent audio before speech.

:class:`Listener` takes every microphone frame of one session. The echo canceller removes the
bot's own reply (what the session sent, laid on the microphone clock) and the VAD judges what is
left, so the bot's voice coming back through a speakerphone is not taken for the user. A noise
suppressor (``noise_reduction``, suppression.py) may clean the microphone audio first: before the
canceller, not after it, because after it the suppressor took away the noise that had masked the
canceller's residual echo, and that residue (speech-like) barged in (``python -m load.noisy``,
docs/measurements/turn-taking.md). The raw audio of the last few seconds is kept, so a turn that
the VAD opens can start a little before the speech onset it detected (``vad_preroll_ms``); the
recogniser gets raw audio.
"""
from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

from pipeline.audio import AudioRing
from pipeline.audio_constants import REPLY_RATE, USER_RATE
from pipeline.conversation.ears.suppression import DELAYS, suppressor
from pipeline.conversation.ears.vad import SileroVAD, VADEvent, VADSettings, VoiceActivity

RECENT_S = 3.0  # raw audio kept: the longest frame (1 s), the VAD's onset delay and the pre-roll fit
REPLY_TAIL = USER_RATE // 2  # a reply's echo trails it: the foreground rule waits this long after it
# Suppressors a session asks for are made here, off the event loop (DeepFilterNet3's takes ~0.2 s
# of CPU to load its model); until one is ready the audio goes on unsuppressed.
_MAKER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="suppressor")
log = logging.getLogger(__name__)


class Listener:
    def __init__(self, vad: VADSettings, echo_cancellation: bool, model: SileroVAD | None = None,
                 noise_reduction: str | None = None):
        self.vad = VoiceActivity(vad, model)
        self.noise_reduction = noise_reduction  # the suppressor asked for (None: none)
        self.suppressor = suppressor(noise_reduction)  # the one in use
        self._coming: Future | None = None  # the one asked for, being made
        self._cleaned = self._judged = 0  # samples into the suppressor, and out of it
        self._shortfall = 0  # silence the canceller hears next, after a change to a suppressor with less delay
        if echo_cancellation:
            from pipeline.conversation.ears.echo import EchoCanceller

            self.echo: "EchoCanceller | None" = EchoCanceller()
        else:
            self.echo = None
        self._recent = AudioRing(int(RECENT_S * USER_RATE))
        self._reply_end = 0  # microphone position where the reply audio sent so far stops playing
        self._held = 0  # samples of a paused reply that the client holds, unplayed

    @property
    def position(self) -> int:
        """Microphone samples received."""
        return self._recent.written

    def hear(self, pcm: np.ndarray) -> list[VADEvent]:
        """One microphone frame (int16 16 kHz): the VAD's events, in order."""
        self._recent.append(pcm)
        if self._coming is not None and self._coming.done():
            self._take(self._coming)
        heard = pcm
        if self.suppressor is not None:
            self._cleaned += len(heard)
            heard = self.suppressor.process(heard)
            self._judged += len(heard)
        if self._shortfall:
            heard, self._shortfall = np.concatenate([np.zeros(self._shortfall, np.int16), heard]), 0
        heard = self.echo.process(heard) if self.echo else heard
        return self.vad.push(heard, foreground=self.position >= self._reply_end + REPLY_TAIL)

    def suppress(self, kind: str | None) -> None:
        """Change the noise suppressor (None: none): the new one is made off the event loop and
        taken at the first frame after it is ready."""
        if kind == self.noise_reduction:
            return
        self.noise_reduction, self._coming = kind, None
        if kind is None:
            self._swap(None)
        else:
            self._coming = _MAKER.submit(suppressor, kind, 0)

    def _take(self, coming: Future) -> None:
        self._coming = None
        try:
            self._swap(coming.result())
        except Exception:  # noqa: BLE001 - its library is missing or broken: the audio stays as it was
            log.exception("noise suppressor %r could not be made; the session goes on without it", self.noise_reduction)

    def _swap(self, new) -> None:
        """``new`` (trim 0) in place of the suppressor in use, mid-stream: the positions after it stay
        the microphone's. It drops as much of its start as its delay exceeds what the old one held
        back, or the canceller hears the shortfall (a few ms) as silence first."""
        held = self._cleaned - self._judged
        lag = DELAYS[new.kind] if new is not None else 0
        if new is not None:
            new.trim = max(0, lag - held)
        self.suppressor, self._cleaned, self._judged = new, 0, 0
        self._shortfall += max(0, held - lag)

    def since(self, sample: int) -> np.ndarray:
        """The raw audio from stream position ``sample`` to now (as much of it as is kept)."""
        return self._recent.last(self.position - max(0, sample))

    @property
    def speaking(self) -> bool:
        return self.vad.speaking

    def reference(self, pcm_24k: np.ndarray) -> None:
        """A reply chunk was sent: it plays after what was sent before it, not before now."""
        self._reply_end = max(self._reply_end, self.position) + len(pcm_24k) * USER_RATE // REPLY_RATE
        if self.echo:
            self.echo.reference(pcm_24k)

    def stop_playback(self, hold: bool = False) -> None:
        """The reply stops playing at the client: cut (what it had not played is dropped) or,
        ``hold``, paused (it keeps that, and plays it first when :meth:`resume_playback` says)."""
        self._held = max(0, self._reply_end - self.position) if hold else 0
        self._reply_end = min(self._reply_end, self.position)
        if self.echo:
            self.echo.stop_playback(hold)

    def resume_playback(self) -> None:
        self._reply_end, self._held = max(self._reply_end, self.position) + self._held, 0
        if self.echo:
            self.echo.resume_playback()


def warm_listening() -> None:
    """Load the process's VAD, Smart Turn and echo canceller now and run each once (onnxruntime's
    first call allocates), so a server's first caller does not pay for it."""
    from pipeline.conversation.ears import smart_turn
    from pipeline.conversation.ears import vad

    Listener(VADSettings(), echo_cancellation=True).hear(np.zeros(vad.WINDOW + vad.CONTEXT, np.int16))
    smart_turn.shared_model().probability(np.zeros(USER_RATE, np.int16))
