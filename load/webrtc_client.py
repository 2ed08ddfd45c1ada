"""A client of OpenAI's Realtime WebRTC interface, over aiortc (the tests' and benchmarks' caller):
it offers a microphone track and the ``oai-events`` data channel, POSTs the offer to
``/v1/realtime/calls`` as OpenAI's documentation says, and then speaks at real time (its track's
own clock), hears the reply track (each frame's arrival and loudness) and reads the events.

It hears as a browser does by default (``receiver="arrival"``: each packet decoded as it arrives,
``pipeline/adapters/webrtc/receive.py``); ``receiver="aiortc"`` keeps aiortc's own receiver, which
holds 80 ms before it decodes.

    async with RtcCall("http://127.0.0.1:8000") as call:
        await call.say(pcm16k)                      # then silence, as a microphone does
        await call.wait(lambda c: c.of("response.done"))
"""
from __future__ import annotations

import asyncio
import json
import time
from collections import deque

import httpx
import numpy as np
from aiortc import RTCPeerConnection, RTCSessionDescription
from aiortc.mediastreams import MediaStreamError

from pipeline.adapters.webrtc import receive
from pipeline.adapters.webrtc.peer import ClockedAudioTrack

MIC_RATE = 16_000
FRAME = MIC_RATE // 50  # 20 ms
LOUD = 200.0  # RMS (int16) above which a received frame counts as sound


class Microphone(ClockedAudioTrack):
    """20 ms frames on the track's clock: what ``say`` queued, else silence."""

    def __init__(self):
        super().__init__(MIC_RATE, FRAME)
        self.queue: deque[np.ndarray] = deque()
        self.spoken_until: float | None = None  # when the last queued sample went out
        self.speech_frames_left = 0  # frames of speech (not its padding) still to go out
        self.speech_ended_at: float | None = None  # when the last of them went out

    def next_frame(self) -> np.ndarray:
        pcm = self.queue.popleft() if self.queue else np.zeros(FRAME, np.int16)
        if self.speech_frames_left:
            self.speech_frames_left -= 1
            if not self.speech_frames_left:
                self.speech_ended_at = time.monotonic()
        if not self.queue and self.spoken_until is None:
            self.spoken_until = time.monotonic()
        return pcm


class RtcCall:
    def __init__(self, base_url: str = "http://127.0.0.1:8000", credential: str | None = None,
                 session: dict | None = None, local_address: str | None = None, receiver: str = "arrival"):
        if receiver not in ("arrival", "aiortc"):
            raise ValueError(f"receiver is 'arrival' or 'aiortc', not {receiver!r}")
        self.receiver = receiver
        self.base_url, self.credential, self.session = base_url.rstrip("/"), credential, session
        self.local_address = local_address
        self.pc = RTCPeerConnection()
        self.mic = Microphone()
        self.events: list[dict] = []
        self.event_times: list[float] = []
        self.heard: list[tuple[float, float]] = []  # (arrival, RMS) of each 20 ms of reply audio received
        self.location: str | None = None
        self.closed = asyncio.Event()
        self._changed = asyncio.Condition()
        self._tasks: list[asyncio.Task] = []

    async def __aenter__(self) -> "RtcCall":
        self.pc.addTrack(self.mic)
        self.channel = self.pc.createDataChannel("oai-events")
        self.channel.on("message", self._on_event)
        self.channel.on("close", self.closed.set)
        self.pc.on("track", self._on_track)
        await self.pc.setLocalDescription(await self.pc.createOffer())
        answer = await self.post_offer(self.pc.localDescription.sdp)
        answer.raise_for_status()
        self.location = answer.headers.get("location")
        await self.pc.setRemoteDescription(RTCSessionDescription(answer.text, "answer"))
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await self.pc.close()

    async def post_offer(self, sdp: str) -> httpx.Response:
        """POST /v1/realtime/calls as OpenAI's clients do: raw SDP, or multipart with a session."""
        headers = {"Authorization": f"Bearer {self.credential}"} if self.credential else {}
        transport = httpx.AsyncHTTPTransport(local_address=self.local_address) if self.local_address else None
        async with httpx.AsyncClient(transport=transport, timeout=30) as client:
            if self.session is not None:
                return await client.post(f"{self.base_url}/v1/realtime/calls", headers=headers,
                                         files={"sdp": (None, sdp), "session": (None, json.dumps(self.session))})
            return await client.post(f"{self.base_url}/v1/realtime/calls", headers={
                **headers, "Content-Type": "application/sdp"}, content=sdp)

    # ------------------------------------------------------------------ what the caller does
    async def say(self, pcm16k: np.ndarray, speech_end: int | None = None) -> None:
        """Queue speech for the microphone (it goes out at real time); returns at once.
        ``speech_end``: the sample where the speech ends (the rest is silence after it): the
        microphone notes when that frame went out (``mic.speech_ended_at``)."""
        pcm = np.concatenate([pcm16k.astype(np.int16), np.zeros(-len(pcm16k) % FRAME, np.int16)])
        self.mic.spoken_until = self.mic.speech_ended_at = None
        self.mic.speech_frames_left = len(self.mic.queue) + -(-(speech_end or len(pcm16k)) // FRAME)
        self.mic.queue.extend(pcm.reshape(-1, FRAME))

    def send(self, event: dict) -> None:
        self.channel.send(json.dumps(event))

    # ------------------------------------------------------------------ what the caller gets
    def of(self, kind: str) -> list[dict]:
        return [e for e in self.events if e.get("type") == kind]

    def loud_after(self, since: float) -> list[float]:
        """Arrival times of loud reply frames after ``since`` (time.monotonic)."""
        return [t for t, rms in self.heard if t > since and rms > LOUD]

    async def wait(self, predicate, timeout: float = 60) -> None:
        async with self._changed:
            await asyncio.wait_for(self._changed.wait_for(lambda: predicate(self)), timeout)

    def _on_event(self, message) -> None:
        self.events.append(json.loads(message))
        self.event_times.append(time.monotonic())
        asyncio.ensure_future(self._notify())

    async def _notify(self) -> None:
        async with self._changed:
            self._changed.notify_all()

    def _on_track(self, track) -> None:
        if self.receiver == "aiortc":
            self._tasks.append(asyncio.ensure_future(self._listen(track)))
            return
        rtp = next(t.receiver for t in self.pc.getTransceivers() if t.receiver.track is track)
        receive.tap(rtp, receive.OPUS_RATE, self._heard)

    def _heard(self, pcm: np.ndarray) -> None:
        self.heard.append((time.monotonic(), float(np.sqrt(np.mean(pcm.astype(np.float64) ** 2)))))
        asyncio.ensure_future(self._notify())

    async def _listen(self, track) -> None:
        try:
            while True:
                frame = await track.recv()
                pcm = frame.to_ndarray().astype(np.float64)
                self.heard.append((time.monotonic(), float(np.sqrt(np.mean(pcm ** 2)))))
                await self._notify()
        except MediaStreamError:
            self.closed.set()
            await self._notify()
