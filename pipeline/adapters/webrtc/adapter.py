"""The OpenAI Realtime protocol over a WebRTC call (``pipeline/adapters/webrtc/peer.py``): the same client
and server events, on the ``oai-events`` data channel, onto the same conversation core as the
WebSocket adapter, of which this is a subclass. What differs is the audio:

- the caller's audio comes from the call's track (``MicAudio`` frames), not in
  ``input_audio_buffer.append`` events;
- reply audio goes to the reply track, not into ``response.output_audio.delta`` events; as on
  OpenAI's WebRTC interface, ``output_audio_buffer.started`` says a response's audio began and
  ``output_audio_buffer.cleared`` that a cut response's queued audio was dropped;
- what the caller heard of a cut reply is known from the track: the samples handed to the
  encoder, less half RTCP's round trip and the receiver's jitter buffer (``JITTER_BUFFER_MS``),
  told to the core as ``Played`` before each microphone frame; ``conversation.item.truncate``
  still works, as on the WebSocket;
- the server holds the playback buffer here (a WebSocket client holds its own): the core is told
  so (``holds_playback``), and whether the track still plays (``Played(playing=...)``), so speech
  over a reply that has been sent whole but still plays is cut by the core (``PlaybackCut``): the
  track drops it, the client hears ``output_audio_buffer.cleared`` and, its item truncated to what
  was heard, ``conversation.item.truncated``, as OpenAI's WebRTC server does;
- a reply paused by speech that may be no turn (``resume_false_interruption``) stops on the track
  within a frame, its queued audio kept, and plays on from there if it resumes.
"""
from __future__ import annotations

from pipeline.adapters.realtime.adapter import RealtimeSession
from pipeline.audio_constants import REPLY_RATE
from pipeline.conversation import commands as C
from pipeline.conversation import events as CE
from pipeline.conversation.reply import COMPLETED
from pipeline.adapters.webrtc.peer import MicAudio, Peer

JITTER_BUFFER_MS = 40.0  # what a browser's receiver holds before it plays (Chrome's NetEq: 20-80 ms)


class WebRTCSession(RealtimeSession):
    def __init__(self, send, backends, cfg=None, session_id=None, smart_turn=None, voices=("default",),
                 model: str = "gapless", observer=None, peer: Peer | None = None, session: dict | None = None,
                 offer=None):
        super().__init__(send, backends, cfg, session_id, smart_turn, voices, model, False, observer,
                         holds_playback=True, offer=offer)
        self.peer = peer
        self.initial = session  # the session object the call was made with (multipart "session")
        self._told: tuple[str | None, float, bool] = (None, 0.0, False)  # the last Played told to the core
        self._speaking: set[str] = set()  # responses whose audio began

    async def start(self) -> None:
        if self.initial:
            await self._configure(dict(self.initial))
        await super().start()

    async def on_frame(self, frame) -> None:
        if isinstance(frame, MicAudio):
            self.core.touch()
            await self._tell_played()
            await self._hear(frame.pcm)
            return
        await super().on_frame(frame)

    async def _tell_played(self) -> None:
        """What the caller heard of the reply on the track, and whether the track still plays."""
        item_id, samples = self.peer.speaker.sent
        heard_ms = 1000 * samples / REPLY_RATE - 500 * self.peer.rtt_s - JITTER_BUFFER_MS
        told = (item_id, heard_ms, not self.peer.speaker.idle)
        if item_id is not None and heard_ms > 0 and told != self._told:
            self._told = told
            await self.core.do(C.Played(*told))

    async def emit(self, ev: CE.Event) -> None:
        if isinstance(ev, CE.ReplyAudio):
            if ev.reply.id not in self._speaking:
                self._speaking.add(ev.reply.id)
                await self.send({"type": "output_audio_buffer.started", "response_id": ev.reply.id})
            self.peer.speaker.push(ev.reply.item_id, ev.pcm)
            return
        if isinstance(ev, (CE.ReplyPaused, CE.ReplyResumed)):  # the track holds what it has, or plays on
            self.peer.speaker.hold(isinstance(ev, CE.ReplyPaused))
            return
        if isinstance(ev, CE.PlaybackCut):
            self.peer.speaker.clear()
            await self.send({"type": "output_audio_buffer.cleared", "response_id": ev.reply_id})
            if ev.audio_end_ms is not None:
                await self.send({"type": "conversation.item.truncated", "item_id": ev.item_id, "content_index": 0,
                                 "audio_end_ms": ev.audio_end_ms})
            return
        if isinstance(ev, CE.ReplyDone):
            self.peer.speaker.hold(False)  # a reply paused before its audio, or ended paused, holds nothing more
        if isinstance(ev, CE.ReplyDone) and ev.reply.id in self._speaking:
            self._speaking.discard(ev.reply.id)
            if ev.reply.status != COMPLETED:
                self.peer.speaker.clear()  # the cut reply stops within the frame being sent
                await self.send({"type": "output_audio_buffer.cleared", "response_id": ev.reply.id})
        await super().emit(ev)
