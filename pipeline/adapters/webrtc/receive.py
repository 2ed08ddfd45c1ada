"""A WebRTC call's audio receive path: RTP Opus packets in, PCM frames out in order, as they arrive.

aiortc's own receiver puts every audio packet in a ``JitterBuffer(capacity=16, prefetch=4)``
(``RTCRtpReceiver.__init__``, not a setting): it decodes a packet only once four more have come
(80 ms at 20 ms a packet), always, and a missing packet stalls it until the buffer overflows
(16 packets, 320 ms). On a good link audio needs no such hold: packets come in order. This path
does what a browser's receiver does instead:

- a packet that is the next in sequence is decoded the moment it arrives (no hold at all);
- after a gap, the packets behind it wait for the missing one for at most ``hold_s``: twice the
  interarrival jitter RFC 3550 (6.4.1) defines, within ``[MIN_HOLD_S, MAX_HOLD_S]``; a packet
  still missing then is lost: its frame is concealed (silence of a frame's length, so the
  stream's clock stays right and the VAD hears the gap as the pause it was), the waiting ones go
  out in order, and the lost one is dropped if it turns up later;
- duplicates and packets older than what went out are dropped; sequence numbers wrap at 2^16;
  at most ``capacity`` packets wait: a jump wider than that (a long outage), or back by more than
  ``MAX_MISORDER`` (the sender started again), goes on from the new packet, what waited let out
  first, the jump not filled in (no silence is made for a jump: a sender cannot make this path
  conceal more than ``capacity`` packets at once).

:class:`Reorder` is the ordering alone (pure: packets and the time in, payloads out),
:class:`AudioReceive` decodes what it lets out (PyAV's libopus, resampled to the rate wanted) and
:func:`tap` puts one in aiortc's place for a receiver, driving its deadline on the event loop.
The server's calls (``peer.py``) and the load tools' caller (``load/webrtc_client.py``) both use it.
"""
from __future__ import annotations

import asyncio
import time
from typing import Callable

import av
import numpy as np
from av import AudioResampler, CodecContext
from av.packet import Packet

OPUS_RATE = 48_000  # Opus's RTP clock
FRAME_S = 0.02  # WebRTC's Opus packets carry 20 ms (browsers' ptime)
MIN_HOLD_S = 0.04  # a packet one place out of order comes a frame (20 ms) after the one behind it
MAX_HOLD_S = 0.08  # never more than aiortc's fixed hold
CAPACITY = 32  # packets waiting behind a gap (640 ms)
MAX_MISORDER = 100  # a packet this far behind is a new start of the sender's numbers (aiortc's rule too)

LOST = None  # what Reorder lets out for a packet that never came


def _ahead(seq: int, of: int) -> int:
    """How far sequence number ``seq`` is after ``of`` (negative: before), modulo 2^16."""
    return (seq - of + 0x8000) % 0x10000 - 0x8000


class Reorder:
    """Packets in sequence order, each let out as soon as everything before it has been (or has
    been given up on): ``push`` a packet as it arrives and ``expire`` when ``deadline`` passes."""

    def __init__(self, capacity: int = CAPACITY, min_hold_s: float = MIN_HOLD_S, max_hold_s: float = MAX_HOLD_S):
        self.capacity, self.min_hold_s, self.max_hold_s = capacity, min_hold_s, max_hold_s
        self.next: int | None = None  # the sequence number to let out next
        self._waiting: dict[int, bytes] = {}  # sequence number -> payload, all after ``next``
        self.deadline: float | None = None  # when the missing ``next`` is given up on
        self.jitter_s = 0.0  # RFC 3550's interarrival jitter estimate
        self._transit: float | None = None
        self.lost = self.late = self.duplicates = self.resyncs = 0

    @property
    def hold_s(self) -> float:
        return min(self.max_hold_s, max(self.min_hold_s, 2 * self.jitter_s))

    def push(self, seq: int, timestamp: int, payload: bytes, now: float) -> list[bytes | None]:
        """One packet (its RTP sequence number and timestamp) arriving at ``now``: the payloads
        that may go out now, in order (``LOST`` for each packet given up on)."""
        transit = now - timestamp / OPUS_RATE
        if self._transit is not None:
            self.jitter_s += (abs(transit - self._transit) - self.jitter_s) / 16
        self._transit = transit
        if self.next is None:
            self.next = seq
        ahead = _ahead(seq, self.next)
        out: list[bytes | None] = []
        if ahead >= self.capacity or ahead < -MAX_MISORDER:
            # a jump (a long outage, or the sender started its numbers again): what waited goes
            # out, and the stream goes on from here; the jump itself is not filled in
            if self._waiting:
                out = self._skip_to(max(self._waiting, key=lambda s: _ahead(s, self.next)) + 1)
            self.next, ahead = seq, 0
            self.resyncs += 1
        elif ahead < 0:
            self.late += 1  # already let out, or given up on
            return []
        if seq in self._waiting:
            self.duplicates += 1
            return []
        self._waiting[seq] = payload
        out += self._release()
        if self._waiting and self.deadline is None:
            self.deadline = now + self.hold_s
        return out

    def expire(self, now: float) -> list[bytes | None]:
        """The missing packet's wait is over (``now`` >= ``deadline``): it is lost; what waited
        behind it goes out (up to the next gap, whose wait starts now)."""
        if self.deadline is None or now < self.deadline:
            return []
        self.deadline = None
        first = min(self._waiting, key=lambda s: _ahead(s, self.next))
        out = self._skip_to(first)
        if self._waiting:
            self.deadline = now + self.hold_s
        return out

    def _skip_to(self, seq: int) -> list[bytes | None]:
        out: list[bytes | None] = []
        self.deadline = None  # the next gap, if any, waits its own hold
        while _ahead(seq, self.next) > 0:
            out.append(self._waiting.pop(self.next, LOST))
            if out[-1] is LOST:
                self.lost += 1
            self.next = (self.next + 1) % 0x10000
        return out + self._release()

    def _release(self) -> list[bytes | None]:
        out: list[bytes | None] = []
        while self.next in self._waiting:
            out.append(self._waiting.pop(self.next))
            self.next = (self.next + 1) % 0x10000
            self.deadline = None
        return out


class AudioReceive:
    """Opus packets in (``push``), mono int16 frames at ``rate`` out, in order and at once:
    ``deliver`` is called with each frame (a lost packet's frame is silence)."""

    def __init__(self, rate: int, deliver: Callable[[np.ndarray], None], reorder: Reorder | None = None):
        self.rate, self.deliver = rate, deliver
        self.reorder = reorder or Reorder()
        self._decoder = CodecContext.create("libopus", "r")
        self._decoder.format, self._decoder.layout, self._decoder.sample_rate = "s16", "mono", OPUS_RATE
        self._resampler = AudioResampler(format="s16", layout="mono", rate=rate) if rate != OPUS_RATE else None
        self._frame = int(rate * FRAME_S)
        self.undecodable = 0  # packets libopus refused (each heard as a lost one)

    def push(self, seq: int, timestamp: int, payload: bytes, now: float | None = None) -> None:
        self._out(self.reorder.push(seq, timestamp, payload, time.monotonic() if now is None else now))

    def expire(self, now: float | None = None) -> None:
        self._out(self.reorder.expire(time.monotonic() if now is None else now))

    def _out(self, payloads: list[bytes | None]) -> None:
        for payload in payloads:
            if payload is LOST:
                self.deliver(np.zeros(self._frame, np.int16))
                continue
            try:
                frames = self._decoder.decode(Packet(payload))
            except av.FFmpegError:  # not Opus: the frame is concealed as a lost one
                self.undecodable += 1
                self.deliver(np.zeros(self._frame, np.int16))
                continue
            for frame in frames:
                self._frame = int(frame.samples * self.rate / frame.sample_rate)
                for out in self._resampler.resample(frame) if self._resampler else [frame]:
                    self.deliver(out.to_ndarray().reshape(-1).astype(np.int16))


RECEIVER_BUFFER = "_RTCRtpReceiver__jitter_buffer"  # where aiortc's RTCRtpReceiver keeps its buffer


class _Tap:
    """Stands where aiortc's receiver keeps its jitter buffer: it takes each packet the receiver
    has checked (codec known, RTCP's statistics fed) and hands aiortc nothing to decode."""

    capacity = CAPACITY

    def __init__(self, on_packet: Callable):
        self.on_packet = on_packet

    def add(self, packet):
        self.on_packet(packet)
        return False, None

    def remove(self, count: int) -> None:
        pass


def _check(receiver) -> None:
    if not hasattr(receiver, RECEIVER_BUFFER):
        raise RuntimeError(f"aiortc's RTCRtpReceiver has no {RECEIVER_BUFFER} (its layout changed): "
                           "the low-latency receive path needs aiortc 1.16's receiver")


def ignore(receiver) -> None:
    """A receiver whose media is not heard (a second audio track, a video track): its packets
    are dropped where aiortc would buffer and decode them, so nothing piles up in a track no one
    reads."""
    _check(receiver)
    setattr(receiver, RECEIVER_BUFFER, _Tap(lambda packet: None))


def tap(receiver, rate: int, deliver: Callable[[np.ndarray], None]) -> AudioReceive:
    """Takes over an aiortc ``RTCRtpReceiver``'s audio (before its packets flow, e.g. in the
    ``track`` event): ``deliver`` gets each 20 ms frame at ``rate`` as it arrives, on the event
    loop. Its track's ``recv`` never returns a frame then."""
    _check(receiver)
    path = AudioReceive(rate, deliver)
    loop = asyncio.get_running_loop()
    timer: list[asyncio.TimerHandle | None] = [None]

    def arm() -> None:
        if timer[0] is not None:
            timer[0].cancel()
        deadline = path.reorder.deadline
        timer[0] = None if deadline is None else loop.call_at(loop.time() + deadline - time.monotonic(), expire)

    def expire() -> None:
        timer[0] = None
        path.expire()
        arm()

    def on_packet(packet) -> None:
        path.push(packet.sequence_number, packet.timestamp, packet.payload)
        arm()

    setattr(receiver, RECEIVER_BUFFER, _Tap(on_packet))
    return path

