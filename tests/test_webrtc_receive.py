"""The WebRTC audio paths (pipeline/adapters/webrtc/receive.py, ClockedAudioTrack in peer.py), in-process:
packets decode in order as they arrive, reordered and lost ones included, against the same Opus
packets decoded in order by a decoder of their own; and a frame's audio leaves in that frame's
own packet, not the next one's. Time is the tests' own clock (``now``), not the wall's."""
from __future__ import annotations

import asyncio
import fractions

import numpy as np
import pytest
from aiortc import RTCPeerConnection, RTCSessionDescription
from aiortc.codecs.opus import OpusEncoder
from av import AudioFrame, AudioResampler, CodecContext
from av.packet import Packet

from pipeline.adapters.webrtc import receive
from pipeline.adapters.webrtc.peer import ClockedAudioTrack, ReplyTrack
from pipeline.adapters.webrtc.receive import LOST, MAX_HOLD_S, AudioReceive, Reorder

RATE = 16_000
N = 12  # packets
TS = 960  # RTP timestamp step of a 20 ms packet


def speechy(seconds: float, rate: int = 48_000) -> np.ndarray:
    t = np.arange(int(seconds * rate)) / rate
    return (6000 * np.sin(2 * np.pi * 220 * t) * (1 + np.sin(2 * np.pi * 3 * t))).astype(np.int16)


def opus_packets(pcm48k: np.ndarray) -> list[bytes]:
    """20 ms Opus packets of mono 48 kHz audio (PyAV's libopus, as a browser's would be)."""
    enc = CodecContext.create("libopus", "w")
    enc.format, enc.layout, enc.sample_rate = "s16", "mono", 48_000
    enc.time_base = fractions.Fraction(1, 48_000)
    packets = []
    for i in range(0, len(pcm48k) - 959, 960):
        frame = AudioFrame.from_ndarray(pcm48k[i:i + 960].reshape(1, -1), format="s16", layout="mono")
        frame.sample_rate, frame.pts, frame.time_base = 48_000, i, fractions.Fraction(1, 48_000)
        packets += [bytes(p) for p in enc.encode(frame)]
    return packets


def reference(packets: list[bytes | None]) -> list[np.ndarray]:
    """The packets decoded one by one in the order given (None: a frame of silence), by a decoder
    and resampler of this test's own."""
    dec = CodecContext.create("libopus", "r")
    dec.format, dec.layout, dec.sample_rate = "s16", "mono", 48_000
    res = AudioResampler(format="s16", layout="mono", rate=RATE)
    out = []
    for p in packets:
        if p is None:
            out.append(np.zeros(RATE // 50, np.int16))
            continue
        for f in dec.decode(Packet(p)):
            out += [x.to_ndarray().reshape(-1) for x in res.resample(f)]
    return out


@pytest.fixture(scope="module")
def packets() -> list[bytes]:
    got = opus_packets(speechy(0.3))
    assert len(got) >= N
    return got[:N]


class Heard:
    def __init__(self):
        self.frames: list[tuple[float, np.ndarray]] = []
        self.now = 0.0

    def __call__(self, pcm):
        self.frames.append((self.now, pcm))


def feed(order: list[int], packets, start_seq: int = 1000, hold_after: list[float] | None = None):
    """Packet i (sequence start_seq + i) arrives at i * 20 ms in ``order``; the path's deadline is
    honoured as the clock runs. Returns what was heard, with the time each frame came out."""
    heard = Heard()
    path = AudioReceive(RATE, heard)
    for k, i in enumerate(order):
        heard.now = 0.02 * k
        while path.reorder.deadline is not None and path.reorder.deadline <= heard.now:
            heard.now = path.reorder.deadline
            path.expire(heard.now)
            heard.now = 0.02 * k
        path.push((start_seq + i) % 0x10000, (i * TS) % 2**32, packets[i], heard.now)
    heard.now = 0.02 * len(order) + 1
    path.expire(heard.now)
    return heard, path


def test_in_order_packets_come_out_the_moment_they_arrive_as_the_reference_decodes_them(packets):
    heard, path = feed(list(range(N)), packets)
    assert [t for t, _ in heard.frames[:N]] == pytest.approx([0.02 * i for i in range(N)])  # no hold
    assert np.array_equal(np.concatenate([p for _, p in heard.frames]), np.concatenate(reference(packets)))
    assert path.reorder.lost == 0


def test_reordered_packets_decode_in_order_and_the_ones_behind_the_gap_wait_only_for_it(packets):
    order = [0, 1, 3, 2, 4, 5, 7, 6, 8, 9, 10, 11]
    heard, path = feed(order, packets)
    assert np.array_equal(np.concatenate([p for _, p in heard.frames]), np.concatenate(reference(packets)))
    times = [t for t, _ in heard.frames]
    assert times[3] == times[2] == pytest.approx(0.06)  # 2 and 3 go out when 2 arrives, one frame late
    assert times[4] == pytest.approx(0.08)  # then on time again
    assert path.reorder.lost == 0


def test_a_lost_packet_is_concealed_after_a_bounded_wait_and_its_late_arrival_dropped(packets):
    order = [0, 1, 2, 4, 5, 6, 7, 8, 3, 9, 10, 11]  # 3 arrives 100 ms late, after its wait is over
    heard, path = feed(order, packets, start_seq=65530)  # the sequence numbers wrap on the way
    pcm = [p for _, p in heard.frames]
    assert len(pcm) == N  # one frame per packet: the clock stays right
    assert np.array_equal(np.concatenate(pcm[:3]), np.concatenate(reference(packets[:3])))
    assert not pcm[3].any() and len(pcm[3]) == RATE // 50  # the lost frame: silence of its length
    assert all(np.abs(p.astype(int)).max() > 500 for p in pcm[4:])  # the rest decodes (sound, not silence)
    times = [t for t, _ in heard.frames]
    assert 0.06 < times[3] <= 0.06 + MAX_HOLD_S  # given up on within the hold, after 4 came at 60 ms
    assert times == sorted(times) and path.reorder.lost == 1 and path.reorder.late == 1


def test_a_packet_that_is_not_opus_is_heard_as_a_lost_one_and_the_stream_goes_on(packets):
    heard = Heard()
    path = AudioReceive(RATE, heard)
    for i, payload in enumerate([packets[0], b"\xff" * 40 + b"\x00" * 1000, packets[2], packets[3]]):
        path.push(i, i * TS, payload, 0.02 * i)
    pcm = [p for _, p in heard.frames]
    assert len(pcm) == 4 and not pcm[1].any() and path.undecodable == 1
    assert np.abs(pcm[3].astype(int)).max() > 500


def test_duplicates_are_dropped_and_a_jump_goes_on_from_the_new_packet_without_filling_it():
    r = Reorder(capacity=4)
    assert r.push(10, 0, b"a", 0.0) == [b"a"]
    assert r.push(10, 0, b"a", 0.001) == [] and r.late == 1  # went out already
    assert r.push(12, 2 * TS, b"c", 0.04) == []  # 11 missing: c waits
    assert r.push(12, 2 * TS, b"c", 0.041) == [] and r.duplicates == 1
    assert r.deadline is not None and r.deadline - 0.04 <= MAX_HOLD_S
    # 30,000 packets on (a sender skipping ahead): what waited goes out, then the new one; no
    # 30,000 frames of silence are made for the jump
    assert r.push(30_012, 30_002 * TS % 2**32, b"j", 0.06) == [LOST, b"c", b"j"] and r.resyncs == 1
    assert r.push(30_013, 30_003 * TS % 2**32, b"k", 0.08) == [b"k"]
    assert r.push(30_000, 0, b"x", 0.09) == [] and r.late == 2  # just behind: late, dropped
    assert r.push(500, 0, b"n", 0.10) == [b"n"] and r.resyncs == 2  # far behind: the sender started again
    assert r.push(501, TS, b"o", 0.12) == [b"o"]


def test_a_frame_goes_out_in_its_own_packet_not_the_next_ones():
    """Reply audio pushed before the track's next frame is in the Opus packet made of that frame.
    (Handed 24 kHz, aiortc's encoder held each frame's audio back to the next packet.)"""
    track = ReplyTrack()
    encoder = OpusEncoder()
    decoder = CodecContext.create("libopus", "r")
    tone = (8000 * np.sin(np.arange(4800) * 2 * np.pi * 440 / 24_000)).astype(np.int16)

    async def go():
        loudness = []
        for i in range(4):
            if i == 2:
                track.push("item", tone)
            packets, _ = encoder.encode(await track.recv())
            assert len(packets) == 1  # one packet per frame, from the first frame on
            pcm = np.concatenate([f.to_ndarray().reshape(-1) for f in decoder.decode(Packet(packets[0]))])
            loudness.append(float(np.sqrt(np.mean(pcm.astype(float) ** 2))))
        return loudness

    loudness = asyncio.run(go())
    assert loudness[1] < 50 and loudness[2] > 1000, loudness  # silent before, loud in the frame it was pushed for


def test_a_tapped_aiortc_receiver_hears_a_real_peer_frame_by_frame():
    """Two aiortc peers on loopback: the receiving one's receiver is tapped; the audio the sender's
    track made arrives, decoded, in order, and never stalls behind a held buffer: the last loud
    frame sent is heard before the sender's next few frames are."""

    class Beeper(ClockedAudioTrack):
        def __init__(self):
            super().__init__(RATE, RATE // 50)
            self.made = 0

        def next_frame(self):
            self.made += 1
            loud = 5 <= self.made < 25
            return (8000 * np.sin(np.arange(320) * 2 * np.pi * 300 / RATE) * loud).astype(np.int16)

    async def go():
        a, b = RTCPeerConnection(), RTCPeerConnection()
        beeper = Beeper()
        a.addTrack(beeper)
        heard: list[tuple[int, float]] = []  # (frames the sender had made, RMS)
        done = asyncio.Event()

        def on_track(track):
            rx = next(t.receiver for t in b.getTransceivers() if t.receiver.track is track)

            def deliver(pcm):
                heard.append((beeper.made, float(np.sqrt(np.mean(pcm.astype(float) ** 2)))))
                if len(heard) > 40:
                    done.set()
            receive.tap(rx, RATE, deliver)

        b.on("track", on_track)
        await a.setLocalDescription(await a.createOffer())
        await b.setRemoteDescription(a.localDescription)
        await b.setLocalDescription(await b.createAnswer())
        await a.setRemoteDescription(RTCSessionDescription(b.localDescription.sdp, "answer"))
        await asyncio.wait_for(done.wait(), 30)
        await a.close()
        await b.close()
        return heard

    heard = asyncio.run(go())
    loud = [made for made, rms in heard if rms > 1000]
    assert len(loud) >= 15  # the beep came through
    # a loud frame is heard while the sender has made at most a frame or two more (Opus's
    # lookahead spreads a frame into the next packet); aiortc's own receiver held 4 more, always
    lags = sorted(made - i for i, made in zip(range(5, 25), loud))
    assert lags[len(lags) // 2] <= 2, loud


def test_a_call_hears_its_first_audio_track_and_buffers_nothing_of_another():
    """An offer with two microphones: the server's peer hears the first as MicAudio; the second's
    packets are dropped where aiortc would decode them into a queue no one reads (unbounded)."""
    from pipeline.adapters.webrtc.peer import MicAudio, Peer

    class Tone(ClockedAudioTrack):
        def __init__(self, hz):
            super().__init__(RATE, RATE // 50)
            self.hz = hz

        def next_frame(self):
            return (8000 * np.sin(np.arange(320) * 2 * np.pi * self.hz / RATE)).astype(np.int16)

    async def go():
        client = RTCPeerConnection()
        client.addTrack(Tone(300))
        client.addTrack(Tone(500))
        client.createDataChannel("oai-events")
        await client.setLocalDescription(await client.createOffer())
        peer = Peer()
        answer = await peer.answer(client.localDescription.sdp)
        await client.setRemoteDescription(RTCSessionDescription(answer, "answer"))
        heard = 0
        while heard < 25:
            item = await asyncio.wait_for(peer.inbox.get(), 30)
            heard += isinstance(item, MicAudio)
        tracks = [t.receiver.track for t in peer.pc.getTransceivers() if t.kind == "audio"]
        queued = [track._queue.qsize() for track in tracks]
        await client.close()
        await peer.close()
        return queued

    queued = asyncio.run(go())
    assert len(queued) == 2 and queued == [0, 0]  # neither track's queue got a frame: both are tapped
