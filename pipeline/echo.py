"""Echo cancellation on the server: the bot's reply, as it plays at the client, removed from the
microphone audio before the VAD judges it.

A speakerphone loops the reply back into the microphone. The server knows every sample it sent
and roughly when it plays: reply audio plays back to back from the moment its first chunk went
out (a client cannot play a chunk before it has it). :class:`EchoCanceller` lays the sent audio
on the microphone stream's own sample clock (the count of microphone samples received when
the chunk was sent) and runs WebRTC's echo canceller (AEC3, through the ``livekit`` package's
``AudioProcessingModule``) over 10 ms blocks: the reference block for those positions first,
then the microphone block. AEC3 estimates the rest of the delay (the client's jitter buffer, the
room) itself; the reference is early, never late, which is what it needs.

Cost: ~7 ms of CPU per second of microphone audio per session (docs/turn-taking.md).
"""
from __future__ import annotations

import numpy as np

from pipeline.audio import int16_to_float, float_to_int16, resample

RATE = 16_000
BLOCK = 160  # 10 ms: the block size the module takes
REFERENCE_S = 20.0  # reply audio laid ahead on the microphone clock, at most (bounded)


class EchoCanceller:
    def __init__(self):
        from livekit import rtc

        self._rtc = rtc
        self._apm = rtc.AudioProcessingModule(echo_cancellation=True)
        self._cap = int(REFERENCE_S * RATE)
        self._ref = np.zeros(self._cap, np.int16)  # ring: reference for mic positions [p, p + cap)
        self._ref_end = 0  # mic position just after the last reference sample laid
        self._mic_pos = 0  # microphone samples received
        self._pending = np.zeros(0, np.int16)  # microphone samples short of a whole block
        self._out_pos = 0  # mic position of the next sample processed
        self.active_until = 0  # mic position after which no reply audio plays: below it, blocks go through AEC

    @property
    def mic_position(self) -> int:
        return self._mic_pos

    def played(self, pcm_24k: np.ndarray) -> None:
        """A reply chunk (int16 24 kHz) was sent: it plays after the audio sent before it, and not
        before now on the microphone clock."""
        pcm = float_to_int16(resample(int16_to_float(pcm_24k), 24_000, RATE))
        start = max(self._ref_end, self._mic_pos)
        pcm = pcm[: max(0, self._out_pos + self._cap - start)]  # never more than the ring holds
        idx = (start + np.arange(len(pcm))) % self._cap
        self._ref[idx] = pcm
        self._ref_end = start + len(pcm)
        # Keep echo cancellation on for a while after the reply's end: the echo trails it.
        self.active_until = self._ref_end + RATE

    def stop_playback(self) -> None:
        """The reply was interrupted: the client drops what it had not played."""
        if self._ref_end > self._mic_pos:
            self._ref_end = self._mic_pos
            self.active_until = self._mic_pos + RATE

    def _reference(self, pos: int, n: int) -> np.ndarray:
        out = np.zeros(n, np.int16)
        lo, hi = max(pos, self._ref_end - self._cap), min(pos + n, self._ref_end)
        if hi > lo:
            out[lo - pos: hi - pos] = self._ref[np.arange(lo, hi) % self._cap]
        return out

    def process(self, pcm: np.ndarray) -> np.ndarray:
        """Microphone int16 16 kHz in; the echo-cancelled audio of every whole 10 ms block so far out
        (so the output lags the input by under 10 ms). Blocks with no reply audio playing near them
        go through untouched."""
        self._mic_pos += len(pcm)
        buf = np.concatenate([self._pending, np.asarray(pcm, np.int16)])
        n = len(buf) // BLOCK * BLOCK
        self._pending = buf[n:]
        out = buf[:n].copy()
        rtc = self._rtc
        for i in range(0, n, BLOCK):
            pos = self._out_pos + i
            if pos >= self.active_until:
                continue
            ref = rtc.AudioFrame(self._reference(pos, BLOCK).tobytes(), RATE, 1, BLOCK)
            self._apm.process_reverse_stream(ref)
            mic = rtc.AudioFrame(out[i:i + BLOCK].tobytes(), RATE, 1, BLOCK)
            self._apm.process_stream(mic)
            out[i:i + BLOCK] = np.frombuffer(bytes(mic.data), np.int16)
        self._out_pos += n
        return out
