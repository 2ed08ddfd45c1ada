"""Wire audio to and from the engines' rates (pipeline/adapters/audio_formats.py), chunk by chunk as
a phone or a Realtime client sends it: nothing held back beyond the filter's few samples (the VAD
hears each 20 ms frame when it comes), and the stream equals the whole clip resampled at once by
another library (scipy's polyphase filter)."""
from __future__ import annotations

import audioop

import numpy as np
import pytest
from scipy.signal import resample_poly

from pipeline.adapters.audio_formats import PCM_24K, PCMU, Decoder, Encoder
from pipeline.audio_constants import USER_RATE


def voice(seconds: float, rate: int) -> np.ndarray:
    t = np.arange(int(seconds * rate)) / rate
    return (5000 * np.sin(2 * np.pi * 300 * t) + 3000 * np.sin(2 * np.pi * 1100 * t)).astype(np.int16)


@pytest.mark.parametrize("fmt", [PCMU, PCM_24K], ids=["phone-ulaw-8k", "realtime-pcm-24k"])
def test_each_20ms_frame_is_heard_when_it_comes_and_the_stream_matches_the_whole(fmt):
    pcm = voice(2.0, fmt.rate)
    n = fmt.rate // 50
    wire = audioop.lin2ulaw(pcm.tobytes(), 2) if fmt is PCMU else pcm.astype("<i2").tobytes()
    step = len(wire) * n // len(pcm)
    dec = Decoder(fmt)
    out, held_ms = [], []
    for k, i in enumerate(range(0, len(wire), step)):
        out.append(dec.decode(wire[i:i + step]))
        held_ms.append(1000 * ((k + 1) * USER_RATE // 50 - sum(map(len, out))) / USER_RATE)
    assert max(held_ms) < 3  # soxr's streaming resampler held 63 ms (8 kHz) and 22 ms (24 kHz) on average
    got = np.concatenate(out + [dec.flush()]).astype(float)
    linear = np.frombuffer(audioop.ulaw2lin(wire, 2), "<i2") if fmt is PCMU else pcm
    ref = resample_poly(linear.astype(float), USER_RATE, fmt.rate) if fmt.rate < USER_RATE else \
        resample_poly(linear.astype(float), 2, 3)
    assert len(got) == len(ref)
    mid = slice(800, len(ref) - 800)  # the filters' edges differ
    lag = int(np.argmax(np.correlate(got[mid][:4000], ref[mid][:4000 - 40], "valid")))  # the filter delay (samples)
    err = got[mid][lag:lag + 8000] - ref[mid][:8000]
    assert lag <= 40 and np.sqrt(np.mean(err ** 2)) < 0.02 * np.sqrt(np.mean(ref[mid] ** 2))


def test_reply_audio_encoded_chunk_by_chunk_comes_out_whole():
    pcm = voice(1.0, 24_000)
    enc = Encoder(PCMU)
    out = b"".join(enc.encode(pcm[i:i + 1920]) for i in range(0, len(pcm), 1920)) + enc.encode(np.zeros(0, np.int16), last=True)
    assert len(out) == 8000  # one μ-law byte a sample at 8 kHz, none lost to the filter
    again = enc.encode(pcm[:1920]) + enc.encode(np.zeros(0, np.int16), last=True)  # the stream starts again
    assert len(again) == 640
