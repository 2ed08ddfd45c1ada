"""A session's ears: echo cancellation, voice activity, and the recent audio before speech.

:class:`Listener` takes every microphone frame of one session. The echo canceller removes the
bot's own reply (what the session sent, laid on the microphone clock) and the VAD judges what is
left, so the bot's voice coming back through a speakerphone is not taken for the user. The raw
audio of the last few seconds is kept, so a turn that the VAD opens can start a little before
the speech onset it detected (``vad_preroll_ms``); the recogniser gets raw audio.
"""
from __future__ import annotations

import numpy as np

from pipeline.audio import AudioRing
from pipeline.audio_constants import USER_RATE
from pipeline.conversation.ears.vad import SileroVAD, VADEvent, VADSettings, VoiceActivity

RECENT_S = 3.0  # raw audio kept: the longest frame (1 s), the VAD's onset delay and the pre-roll fit


class Listener:
    def __init__(self, vad: VADSettings, echo_cancellation: bool, model: SileroVAD | None = None):
        self.vad = VoiceActivity(vad, model)
        if echo_cancellation:
            from pipeline.conversation.ears.echo import EchoCanceller

            self.echo: "EchoCanceller | None" = EchoCanceller()
        else:
            self.echo = None
        self._recent = AudioRing(int(RECENT_S * USER_RATE))

    @property
    def position(self) -> int:
        """Microphone samples received."""
        return self._recent.written

    def hear(self, pcm: np.ndarray) -> list[VADEvent]:
        """One microphone frame (int16 16 kHz): the VAD's events, in order."""
        self._recent.append(pcm)
        return self.vad.push(self.echo.process(pcm) if self.echo else pcm)

    def since(self, sample: int) -> np.ndarray:
        """The raw audio from stream position ``sample`` to now (as much of it as is kept)."""
        return self._recent.last(self.position - max(0, sample))

    @property
    def speaking(self) -> bool:
        return self.vad.speaking

    def reference(self, pcm_24k: np.ndarray) -> None:
        if self.echo:
            self.echo.reference(pcm_24k)

    def stop_playback(self) -> None:
        if self.echo:
            self.echo.stop_playback()


def warm_listening() -> None:
    """Load the process's VAD, Smart Turn and echo canceller now and run each once (onnxruntime's
    first call allocates), so a server's first caller does not pay for it."""
    from pipeline.conversation.ears import smart_turn
    from pipeline.conversation.ears import vad

    Listener(VADSettings(), echo_cancellation=True).hear(np.zeros(vad.WINDOW + vad.CONTEXT, np.int16))
    smart_turn.shared_model().probability(np.zeros(USER_RATE, np.int16))
