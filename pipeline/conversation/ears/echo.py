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

AEC3 has to learn the echo path before it lets speech through: with a reply playing and no echo
at all (a headset), it held back a person's speech for ~1 s at the start of a session (a VAD
onset 1016 ms late against 120 ms without it, tests/test_turn_taking.py), and ~0.6 s for a
person who spoke at the reply's first chunk. So the canceller also tells whether the microphone
carries the reply (:attr:`use_cancelled`): while a reply plays, the normalised cross-correlation
of the last second of microphone audio with the reference, over delays of 0-500 ms, every
100 ms until it is known and every 250 ms after. The echo alone peaks near 1.0; a person (with
or without the echo under them) far lower. An echo is heard (from then on, for the session, the
VAD judges the cancelled audio) when a peak is unmistakable (``ECHO_CERTAIN``), or over
``ECHO_CORRELATION`` at the same delay in every check over a whole window (an echo path's
delay holds; a chance likeness between two voices, seen again by overlapping windows, does not:
two espeak voices peaked 0.28-0.40 at one delay over 0.5 s). A loud microphone that the reply does not explain is a
person: the VAD judges the raw audio at once, so speech at the reply's very first chunk barges
in as fast as later; a person once heard stays heard through one chance peak (only a peak seen
again at its delay, or an unmistakable one, is an echo under them). 0.5 s of loud reply audio with no echo heard means there is none (the raw
audio from then on). Until anything is known the cancelled audio is used.

Cost, with the VAD after it: ~22 ms of CPU per second of microphone audio per session while a
reply plays (~4 ms with nothing playing), of which ~1 ms per echo check (docs/turn-taking.md).
"""
from __future__ import annotations

import numpy as np
from scipy.signal import fftconvolve

from pipeline.audio import AudioRing, float_to_int16, int16_to_float, resample
from pipeline.audio_constants import REPLY_RATE, USER_RATE

BLOCK = 160  # 10 ms: the block size the module takes
REFERENCE_S = 20.0  # reply audio laid ahead on the microphone clock, at most (bounded)
WINDOW = USER_RATE  # microphone audio correlated with the reference (1 s)
MAX_DELAY = USER_RATE // 2  # delays looked at: 0-500 ms after the reference
CHECK_EVERY = USER_RATE // 4  # once it is known whether the microphone hears the reply
FIRST_CHECK_EVERY = USER_RATE // 10  # until then: the first 0.5 s of a session's reply decides fast
# Peak normalised correlation that means "the microphone hears the reply". Measured on espeak-ng
# speech (tests/test_turn_taking.py): a -10 dB echo alone 0.98-1.0; a person as loud as the
# reply on top of it 0.27-0.54; no echo, a person talking (the same espeak voice as the reply,
# so the worst case for chance correlation) 0.00-0.16.
ECHO_CORRELATION = 0.25
ECHO_CERTAIN = 0.8  # one peak this high is the echo alone (measured 0.98-1.0; a person over it <= 0.61)
SAME_DELAY = 32  # samples (2 ms): two peaks this close are one echo path
QUIET_MIC = 0.001  # RMS (of full scale): a microphone this quiet while the reply is loud hears no echo
LOUD_REFERENCE = 0.005  # RMS (of full scale) of reference audio that should echo audibly
NO_ECHO_AFTER = USER_RATE // 2  # samples of loud reference with no echo heard before trusting the raw audio


class EchoCanceller:
    def __init__(self):
        from livekit import rtc

        self._rtc = rtc
        self._apm = rtc.AudioProcessingModule(echo_cancellation=True)
        self._cap = int(REFERENCE_S * USER_RATE)
        self._ref = np.zeros(self._cap, np.int16)  # ring: reference for mic positions [p, p + cap)
        self._ref_end = 0  # mic position just after the last reference sample laid
        self._held: np.ndarray | None = None  # a paused reply's reference the client holds, unplayed
        self._mic_pos = 0  # microphone samples received
        self._pending = np.zeros(0, np.int16)  # microphone samples short of a whole block
        self._out_pos = 0  # mic position of the next sample processed
        self.active_until = 0  # mic position after which no reply audio plays: below it, blocks go through AEC
        self._raw = AudioRing(WINDOW)  # the last second of microphone audio processed
        self._since_check = 0
        self._loud_checked = 0  # samples of loud reference the echo check has looked at
        self.echo_heard = False  # the microphone has been heard carrying the reply (sticky)
        self.person_heard = False  # the last check heard a loud microphone the reply does not explain
        self._echo_delay: int | None = None  # delay of the last check's peak, if over ECHO_CORRELATION
        self._echo_since = 0  # mic position of the first check of a run of peaks at that delay
        self.last_correlation = 0.0

    def reference(self, pcm_24k: np.ndarray) -> None:
        """A reply chunk (int16 24 kHz) was sent: it plays after the audio sent before it, and not
        before now on the microphone clock."""
        self._lay(float_to_int16(resample(int16_to_float(pcm_24k), REPLY_RATE, USER_RATE)))

    def _lay(self, pcm: np.ndarray) -> None:
        """Reference audio at 16 kHz, after what was laid before it and not before now."""
        start = max(self._ref_end, self._mic_pos)
        pcm = pcm[: max(0, self._out_pos + self._cap - start)]  # never more than the ring holds
        idx = (start + np.arange(len(pcm))) % self._cap
        self._ref[idx] = pcm
        self._ref_end = start + len(pcm)
        # Keep echo cancellation on for a while after the reply's end: the echo trails it.
        self.active_until = self._ref_end + USER_RATE

    def stop_playback(self, hold: bool = False) -> None:
        """The reply was interrupted: the client drops what it had not played; or, ``hold``, paused:
        the client keeps it, and it plays when the reply resumes (:meth:`resume_playback`)."""
        self._held = self._reference(self._mic_pos, max(0, self._ref_end - self._mic_pos)) if hold else None
        if self._ref_end > self._mic_pos:
            self._ref_end = self._mic_pos
            self.active_until = self._mic_pos + USER_RATE

    def resume_playback(self) -> None:
        """The paused reply plays again: what the client held plays first, from now."""
        held, self._held = self._held, None
        if held is not None and len(held):
            self._lay(held)

    def _reference(self, pos: int, n: int) -> np.ndarray:
        out = np.zeros(n, np.int16)
        lo, hi = max(pos, self._ref_end - self._cap), min(pos + n, self._ref_end)
        if hi > lo:
            out[lo - pos: hi - pos] = self._ref[np.arange(lo, hi) % self._cap]
        return out

    @property
    def known(self) -> bool:
        """Whether it is known if the microphone hears the reply (an echo heard, or none after
        NO_ECHO_AFTER samples of loud reply audio, unless the last check saw an echo-like peak:
        under steady noise an echo correlates ~0.5 and takes a whole window to be sure of)."""
        return self.echo_heard or (self._loud_checked >= NO_ECHO_AFTER and self._echo_delay is None)

    @property
    def use_cancelled(self) -> bool:
        """Whether the VAD should judge the cancelled audio (an echo was heard, or nothing is known
        yet and the microphone is not a person the reply does not explain) rather than the raw."""
        return self.echo_heard or (not self.known and not self.person_heard)

    def _check_echo(self, span: int) -> None:
        """Correlate the last second of microphone audio with the reference; ``span`` samples of
        it are new since the last check."""
        end = self._out_pos
        ref = self._reference(end - WINDOW - MAX_DELAY, WINDOW + MAX_DELAY).astype(np.float32) / 32768.0
        recent = ref[MAX_DELAY:]
        if np.sqrt(np.mean(recent ** 2)) < LOUD_REFERENCE:
            return  # nothing audible played in this second: nothing to tell from it
        mic = np.pad(self._raw.last(WINDOW).astype(np.float32) / 32768.0, (WINDOW - min(WINDOW, self._raw.written), 0))
        self._loud_checked += span
        if np.sqrt(np.mean(mic ** 2)) < QUIET_MIC:
            self.last_correlation, self.person_heard, self._echo_delay = 0.0, False, None
            return  # the reply is loud and the microphone silent: no echo
        # corr[i]: the microphone against the reference i samples later than a delay of MAX_DELAY
        corr = fftconvolve(ref, mic[::-1], mode="valid")
        sq = np.concatenate([[0.0], np.cumsum(ref.astype(np.float64) ** 2)])
        ref_energy = sq[WINDOW:] - sq[:-WINDOW]
        audible = ref_energy > 0.01 * ref_energy.max()  # a near-silent stretch of reference says nothing
        score = np.zeros(len(corr))
        score[audible] = np.abs(corr[audible]) / np.sqrt(ref_energy[audible] * float(np.dot(mic, mic)))
        peak = int(np.argmax(score))
        self.last_correlation = float(score[peak])
        delay = MAX_DELAY - peak
        echo_like = self.last_correlation >= ECHO_CORRELATION
        again = echo_like and self._echo_delay is not None and abs(delay - self._echo_delay) <= SAME_DELAY
        if not again:
            self._echo_since = end  # a new run of peaks (or none)
        certain = self.last_correlation >= ECHO_CERTAIN
        if certain or (echo_like and end - self._echo_since >= WINDOW):
            self.echo_heard = True
        self._echo_delay = delay if echo_like else None
        # A person once heard stays heard through one chance peak (two voices, 0.29 at some delay):
        # only a peak seen again at its delay, or a certain one, is the echo under them.
        self.person_heard = not echo_like or (self.person_heard and not again and not certain)

    def process(self, pcm: np.ndarray) -> np.ndarray:
        """Microphone int16 16 kHz in; the echo-cancelled audio of every whole 10 ms block so far out
        (so the output lags the input by under 10 ms). Blocks with no reply audio playing near them
        go through untouched."""
        self._mic_pos += len(pcm)
        buf = np.concatenate([self._pending, np.asarray(pcm, np.int16)])
        n = len(buf) // BLOCK * BLOCK
        self._pending = buf[n:]
        out = buf[:n].copy()
        self._raw.append(out)
        rtc = self._rtc
        for i in range(0, n, BLOCK):
            pos = self._out_pos + i
            if pos >= self.active_until:
                continue
            ref = rtc.AudioFrame(self._reference(pos, BLOCK).tobytes(), USER_RATE, 1, BLOCK)
            self._apm.process_reverse_stream(ref)
            mic = rtc.AudioFrame(out[i:i + BLOCK].tobytes(), USER_RATE, 1, BLOCK)
            self._apm.process_stream(mic)
            out[i:i + BLOCK] = np.frombuffer(bytes(mic.data), np.int16)
        self._out_pos += n
        if self._out_pos < self.active_until + USER_RATE:  # a reply plays, or just did
            self._since_check += n
            if self._since_check >= (CHECK_EVERY if self.known else FIRST_CHECK_EVERY):
                span, self._since_check = self._since_check, 0
                self._check_echo(span)
        return out if self.use_cancelled else buf[:n]
