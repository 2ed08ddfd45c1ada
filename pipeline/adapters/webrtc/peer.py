"""One WebRTC call's peer connection (aiortc), as the Connection a session is served over.

The browser (or any client written for OpenAI's WebRTC interface) offers audio and a data channel
named ``oai-events``; :meth:`Peer.answer` checks the offer, answers it, and from then on:

- the caller's Opus is decoded as each packet arrives (``receive.py``: no fixed jitter-buffer
  hold), at the recogniser's rate, and handed to the session as :class:`MicAudio` frames, in
  order with the channel's events;
- the session's reply audio goes into :class:`ReplyTrack`, whose ``recv`` aiortc's sender calls:
  it hands out 20 ms frames on its own clock (as aiortc's ``AudioStreamTrack`` does), reply audio
  where there is some, silence otherwise, so there is no pacing loop of ours beside aiortc's;
  a cut reply is dropped from it at once (``clear``), within the frame being sent;
- a peer whose ICE does not connect within ``ICE_CONNECT_WITHIN_S`` is closed, and so is one
  whose connection fails or closes: the session then ends as when a WebSocket client leaves.

An offer cannot aim this server's packets (:class:`IcePolicy`): it may carry at most
``max_candidates`` ICE candidates (more is refused), and a candidate this server would send
connectivity checks to must be a public unicast address that is not one of this host's own,
unless the operator allows its network (``webrtc.allowed_candidate_networks``); names (mDNS
``.local`` host candidates) are never resolved. The others are dropped from the offer, and so is
``a=end-of-candidates``: the server keeps listening, and a caller whose checks reach it is
learnt from them (a peer-reflexive candidate, RFC 8445 7.3.1.3) and answered there, as an
ICE-lite server would. So a caller behind NAT, or on the server's own network, still connects,
while the checks the server starts go only where an allowed candidate points, at aioice's pace
(one new check per 20 ms), for at most ``ICE_CONNECT_WITHIN_S``.

Nothing here is unbounded: the inbox (events and microphone frames), the reply audio queued and
the data channel's send buffer each have a cap.
"""
from __future__ import annotations

import asyncio
import fractions
import logging
import time
from collections import Counter, deque
from dataclasses import dataclass
from typing import Callable

import numpy as np
from aiortc import RTCConfiguration, RTCIceServer, RTCPeerConnection, RTCSessionDescription
from aiortc.mediastreams import MediaStreamError, MediaStreamTrack
from aiortc.sdp import SessionDescription
from av import AudioFrame, AudioResampler

from pipeline.adapters.webrtc import receive
from pipeline.adapters.webrtc.config import MAX_CANDIDATES, IcePolicy  # noqa: F401 - the offer's policy
from pipeline.audio_constants import REPLY_RATE, USER_RATE
from pipeline.door.bodies import MAX_SDP_BYTES
from pipeline.engines import ClientGone
from pipeline.conversation.history import new_id

log = logging.getLogger(__name__)

DATA_CHANNEL = "oai-events"
ICE_CONNECT_WITHIN_S = 15.0
FRAME_S = 0.02
WIRE_RATE = 48_000  # Opus's rate: frames handed to aiortc's encoder at it go out at once
REPLY_FRAME = int(REPLY_RATE * FRAME_S)  # 480 samples at 24 kHz
MAX_QUEUED_REPLY_S = 30.0  # reply audio waiting for the track (the session paces it a little ahead)
MAX_INBOX = 512  # events and 20 ms microphone frames waiting for the session (10 s of audio)
MAX_CHANNEL_BUFFER = 1 << 20  # bytes the data channel may hold unsent before the peer counts as gone
MAX_EARLY_EVENTS = 256  # events sent before the data channel opened, kept for it
STATS_EVERY_S = 5.0


class OfferRefused(Exception):
    """An offer this server cannot answer: HTTP ``status`` with ``code`` and ``message``."""

    def __init__(self, code: str, message: str, status: int = 400):
        super().__init__(message)
        self.code, self.message, self.status = code, message, status


@dataclass(frozen=True)
class MicAudio:
    """20 ms of the caller's microphone, int16 at the recogniser's rate."""

    pcm: np.ndarray


def check_offer(sdp: str, policy: IcePolicy | None = None) -> tuple[str, Counter]:
    """``sdp`` as this server answers it: an SDP offer with an audio section that offers Opus, at
    most ``policy.max_candidates`` candidates, those the policy refuses dropped (and
    ``a=end-of-candidates``, so that a caller is still learnt from its own checks). Returns it
    with the count of dropped candidates by reason; raises OfferRefused."""
    policy = policy or IcePolicy()
    if not sdp.strip() or len(sdp.encode()) > MAX_SDP_BYTES:
        raise OfferRefused("invalid_sdp", f"the offer must be an SDP body of at most {MAX_SDP_BYTES} bytes")
    lines = sdp.splitlines()
    candidates = [line for line in lines if line.startswith("a=candidate:")]
    if len(candidates) > policy.max_candidates:
        raise OfferRefused("too_many_candidates", f"the offer carries {len(candidates)} ICE candidates; at most "
                                                  f"{policy.max_candidates} are taken (browsers send a handful)")
    dropped: Counter = Counter()
    kept = []
    for line in lines:
        if line.strip() == "a=end-of-candidates":
            continue
        if line.startswith("a=candidate:"):
            fields = line.split()
            why = "malformed" if len(fields) < 8 else "transport" if fields[2].lower() != "udp" \
                else policy.verdict(fields[4])
            if why is not None:
                dropped[why] += 1
                continue
        kept.append(line)
    sdp = "\r\n".join(kept) + "\r\n"
    try:
        parsed = SessionDescription.parse(sdp)
    except Exception as exc:  # noqa: BLE001 - aiortc's parser raises whatever it meets
        raise OfferRefused("invalid_sdp", f"the offer is not valid SDP ({type(exc).__name__})") from None
    if not sdp.lstrip().startswith("v=0") or not parsed.media:
        raise OfferRefused("invalid_sdp", "the offer is not an SDP offer (v=0, then its media sections)")
    audio = [m for m in parsed.media if m.kind == "audio"]
    if not audio:
        raise OfferRefused("no_audio", "the offer has no audio section: offer the microphone's track (sendrecv)")
    if not any(c.mimeType.lower() == "audio/opus" for m in audio for c in m.rtp.codecs):
        raise OfferRefused("unsupported_codec", "the offer's audio has no Opus; this server speaks Opus only")
    return sdp, dropped


class ClockedAudioTrack(MediaStreamTrack):
    """An audio track that hands aiortc's sender one frame (``frame`` samples of int16 at
    ``rate``) per frame's duration on its own clock, as aiortc's ``AudioStreamTrack`` does; what
    the frame holds is ``next_frame()``'s.

    The frame goes out at Opus's own rate (``WIRE_RATE``, upsampled here with PyAV's resampler,
    whose filter delays it by under a millisecond): handed any other rate, aiortc's encoder
    resamples into a fixed 960-sample frame and, the resampler holding back its last samples,
    sends each frame's audio only with the next one, 20 ms late."""

    kind = "audio"

    def __init__(self, rate: int, frame: int):
        super().__init__()
        self.rate, self.frame = rate, frame
        self._start: float | None = None
        self._timestamp = 0
        self._wire = AudioResampler(format="s16", layout="mono", rate=WIRE_RATE) if rate != WIRE_RATE else None
        self._fifo = np.zeros(0, np.int16)  # upsampled audio not yet sent (under a frame)

    def next_frame(self) -> np.ndarray:
        raise NotImplementedError

    async def recv(self):
        if self.readyState != "live":
            raise MediaStreamError
        if self._start is None:
            self._start = time.time()
        else:
            self._timestamp += self.frame
            wait = self._start + self._timestamp / self.rate - time.time()
            if wait > 0:
                await asyncio.sleep(wait)  # the track's clock: one frame per frame's duration
        return self._to_wire(self.next_frame())

    def _to_wire(self, pcm: np.ndarray) -> AudioFrame:
        if self._wire is not None:
            frame = AudioFrame.from_ndarray(pcm.reshape(1, -1), format="s16", layout="mono")
            frame.sample_rate, frame.pts, frame.time_base = self.rate, self._timestamp, fractions.Fraction(1, self.rate)
            self._fifo = np.concatenate([self._fifo] + [f.to_ndarray().reshape(-1) for f in self._wire.resample(frame)])
            n = self.frame * WIRE_RATE // self.rate
            if len(self._fifo) < n:  # the first frame only: the resampler's filter delay, as silence
                self._fifo = np.concatenate([np.zeros(n - len(self._fifo), np.int16), self._fifo])
            pcm, self._fifo = self._fifo[:n], self._fifo[n:]
        out = AudioFrame.from_ndarray(pcm.reshape(1, -1), format="s16", layout="mono")
        out.sample_rate, out.pts = WIRE_RATE, self._timestamp * WIRE_RATE // self.rate
        out.time_base = fractions.Fraction(1, WIRE_RATE)
        return out


class ReplyTrack(ClockedAudioTrack):
    """The reply's outgoing audio: 20 ms frames of reply audio where there is some, silence
    otherwise. ``sent``: the reply item on the wire and how many of its samples have gone to the
    encoder."""

    def __init__(self):
        super().__init__(REPLY_RATE, REPLY_FRAME)
        self._queue: deque[tuple[str, np.ndarray]] = deque()
        self._queued = 0  # samples in the queue
        self.sent: tuple[str | None, int] = (None, 0)
        self.dropped = 0  # samples refused for lack of room
        self.held = False  # a paused reply's audio waits in the queue

    def push(self, item_id: str, pcm: np.ndarray) -> None:
        if self._queued + len(pcm) > MAX_QUEUED_REPLY_S * REPLY_RATE:
            self.dropped += len(pcm)
            return
        self._queue.append((item_id, pcm))
        self._queued += len(pcm)

    def clear(self) -> None:
        self._queue.clear()
        self._queued = 0
        self.held = False

    def hold(self, held: bool) -> None:
        """A paused reply: silence goes out and its queued audio waits (``held``), or plays on."""
        self.held = held

    @property
    def idle(self) -> bool:
        return not self._queue

    def next_frame(self) -> np.ndarray:
        out = np.zeros(REPLY_FRAME, np.int16)
        filled = 0
        while filled < REPLY_FRAME and self._queue and not self.held:
            item_id, pcm = self._queue[0]
            n = min(REPLY_FRAME - filled, len(pcm))
            out[filled:filled + n] = pcm[:n]
            filled += n
            self._queued -= n
            if n == len(pcm):
                self._queue.popleft()
            else:
                self._queue[0] = (item_id, pcm[n:])
            before = self.sent[1] if self.sent[0] == item_id else 0
            self.sent = (item_id, before + n)
        return out


class Peer:
    """One call: the peer connection, its inbox and its reply track. It is the session's
    Connection (``receive``, ``send``, ``close``)."""

    def __init__(self, ice_servers: list[dict] | None = None, on_stats: Callable[[str, float, int], None] | None = None,
                 policy: IcePolicy | None = None):
        self.id = new_id("rtc")
        self.policy = policy or IcePolicy()
        self.dropped_candidates: Counter = Counter()  # the offer's candidates not taken, by reason
        config = RTCConfiguration(iceServers=[RTCIceServer(**s) for s in ice_servers or []])
        self.pc = RTCPeerConnection(config)
        self.speaker = ReplyTrack()
        self.inbox: asyncio.Queue = asyncio.Queue(MAX_INBOX)
        self.channel = None
        self.channel_open = asyncio.Event()
        self._early: deque[str] = deque(maxlen=MAX_EARLY_EVENTS)  # sent before the channel opened
        self.dropped_mic_frames = 0
        self.mic: receive.AudioReceive | None = None  # the caller's audio path, once its track is known
        self.on_stats = on_stats or (lambda direction, jitter_s, lost: None)
        self.rtt_s = 0.0  # the latest round trip RTCP measured
        self._tasks: set[asyncio.Task] = set()
        self._closed = False
        self._lost = {"in": 0, "out": 0}
        self.pc.on("track", self._on_track)
        self.pc.on("datachannel", self._on_datachannel)
        self.pc.on("connectionstatechange", self._on_state)
        self._connected = asyncio.Event()

    async def answer(self, offer_sdp: str) -> str:
        """Check and answer the offer; returns the answer's SDP (ICE candidates gathered in it)."""
        offer_sdp, self.dropped_candidates = check_offer(offer_sdp, self.policy)
        try:
            await self.pc.setRemoteDescription(RTCSessionDescription(offer_sdp, "offer"))
            self.pc.addTrack(self.speaker)
            await self.pc.setLocalDescription(await self.pc.createAnswer())
        except Exception as exc:  # noqa: BLE001 - aiortc refuses what it cannot negotiate
            await self.close()
            raise OfferRefused("invalid_sdp", f"the offer cannot be answered: {exc}"[:300]) from None
        self._spawn(self._watch())
        return self.pc.localDescription.sdp

    # ------------------------------------------------------------------ Connection
    async def receive(self):
        return await self.inbox.get()

    async def send(self, frame: bytes | str) -> None:
        if self._closed:
            raise ClientGone()
        if self.channel is None or not self.channel_open.is_set():
            self._early.append(frame)  # the channel opens after the answer: they go out then
            return
        if self.channel.bufferedAmount > MAX_CHANNEL_BUFFER:
            log.warning("call %s: the data channel holds %d bytes unread: closing", self.id, self.channel.bufferedAmount)
            await self.close()
            raise ClientGone()
        self.channel.send(frame)

    async def close(self, code: int = 1000, reason: str = "") -> None:
        if self._closed:
            return
        self._closed = True
        self._put(None)  # the session ends at its next receive
        for task in self._tasks - {asyncio.current_task()}:
            task.cancel()
        self.speaker.stop()
        await self.pc.close()

    # ------------------------------------------------------------------ aiortc's events
    def _spawn(self, coro) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _put(self, item) -> None:
        try:
            self.inbox.put_nowait(item)
        except asyncio.QueueFull:
            if item is None:  # the end must get through: make room for it
                self.inbox.get_nowait()
                self.inbox.put_nowait(None)
            elif isinstance(item, MicAudio):
                self.dropped_mic_frames += 1
            else:
                log.warning("call %s: the session is not keeping up with the data channel: closing", self.id)
                self._spawn(self.close())

    def _on_track(self, track) -> None:
        """The caller's audio: its receiver's packets are decoded as they arrive (``receive.tap``),
        not after aiortc's 80 ms jitter buffer and decoder thread."""
        receiver = next(t.receiver for t in self.pc.getTransceivers() if t.receiver.track is track)
        if track.kind != "audio" or self.mic is not None:
            receive.ignore(receiver)  # not heard: not buffered or decoded either (aiortc's queue is unbounded)
            return
        self.mic = receive.tap(receiver, USER_RATE, lambda pcm: self._put(MicAudio(pcm)))

    def _on_datachannel(self, channel) -> None:
        if channel.label != DATA_CHANNEL or self.channel is not None:
            log.info("call %s: data channel %r ignored (events go on %r)", self.id, channel.label, DATA_CHANNEL)
            return
        self.channel = channel
        if channel.readyState == "open":
            self._opened()
        channel.on("open", self._opened)
        channel.on("message", lambda message: self._put(message if isinstance(message, str) else message.decode(
            "utf-8", "replace")))
        channel.on("close", lambda: self._spawn(self.close()))

    def _opened(self) -> None:
        while self._early:
            self.channel.send(self._early.popleft())
        self.channel_open.set()

    async def _on_state(self) -> None:
        if self.pc.connectionState == "connected":
            self._connected.set()
        elif self.pc.connectionState in ("failed", "closed"):
            await self.close()

    async def _watch(self) -> None:
        """Close a peer whose ICE does not connect in time; then read RTCP's numbers now and then."""
        try:
            await asyncio.wait_for(self._connected.wait(), ICE_CONNECT_WITHIN_S)
        except TimeoutError:
            log.info("call %s: ICE did not connect within %g s: closing", self.id, ICE_CONNECT_WITHIN_S)
            await self.close()
            return
        while True:
            await asyncio.sleep(STATS_EVERY_S)
            await self._read_stats()

    async def _read_stats(self) -> None:
        report = await self.pc.getStats()
        for stats in report.values():
            direction = {"inbound-rtp": "in", "remote-inbound-rtp": "out"}.get(stats.type)
            if direction is None or stats.kind != "audio":
                continue
            lost = max(0, stats.packetsLost - self._lost[direction])
            self._lost[direction] = max(self._lost[direction], stats.packetsLost)
            self.on_stats(direction, stats.jitter / 48_000, lost)  # Opus's RTP clock is 48 kHz
            if direction == "out" and stats.roundTripTime:
                self.rtt_s = stats.roundTripTime
