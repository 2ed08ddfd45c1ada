"""Protocol v1 (docs/protocol.md): binary msgpack frames onto one :class:`~pipeline.conversation.Conversation`.

A :class:`Session` parses each client frame (``pipeline.protocol``), hands it to the conversation
core, and turns what the core reports into v1 messages sent through one ``send`` coroutine. All
per-session state lives in the session and its core, never in globals: one session's bad frame,
error or disconnect touches nothing another holds. Bad input costs one ``error`` message.

The conversation logic (turns, replies, barge-in, slots, engine failures) is the core's; this
module only knows v1's framing and message shapes. The engine contract and session settings are
re-exported here for the code written against them.
"""
from __future__ import annotations

import asyncio
import time
from typing import Awaitable, Callable

import numpy as np

from pipeline import protocol as P
from pipeline.agent import DEFAULT_VOICE, MAX_VOICE_CLIP_S, BadSetting
from pipeline.conversation import Conversation, Refusal, WireSession
from pipeline.calls import ToolResultError
from pipeline.engines import Backends, EngineUnavailable, NoFreeSlot, ToolCall, UnknownStream
from pipeline.history import Item
from pipeline.reply import CANCELLED, Reply
from pipeline.resume import InFlight, Snapshot
from pipeline.session_config import SessionConfig

# The engine contract and the session settings, for code written against this module.
__all__ = ["Session", "Backends", "EngineUnavailable", "NoFreeSlot", "UnknownStream", "SessionConfig"]

V1_NAMES = {field: name for name, field in P.SETTINGS.items()}  # AgentSettings field -> v1 setting name


def _monotonic() -> float:
    return time.monotonic()  # looked up at each call: tests replace this module's ``time``


class Session(WireSession):
    resumable = True  # a dropped connection may resume (pipeline/keeper.py)

    def __init__(
        self,
        send: Callable[[bytes], Awaitable[None]],
        backends: Backends,
        cfg: SessionConfig | None = None,
        session_id: str | None = None,
        smart_turn=None,
        voices: tuple[str, ...] = (DEFAULT_VOICE,),
    ):
        self.core = Conversation(self, backends, cfg, session_id, smart_turn, voices, clock=_monotonic)
        self.id = self.core.id
        self._send_raw = send
        self._send_lock = asyncio.Lock()
        self._clip: list[np.ndarray] = []  # voice.clip pieces so far
        self._clip_samples = 0
        # A turn's response may span several replies (one that calls tools, a filler, the one that uses
        # the results): its audio's seq runs on across them, and it ends with one response.done.
        self._seq_turn, self._seq = 0, 0
        self._done_turn = 0  # the last turn whose response.done went out
        self._open_turn: int | None = None  # a turn whose reply waits on tool results
        self._in_flight: InFlight | None = None  # the audio of the last reply that sent any, by seq
        self.resume_fields: dict | None = None  # what session.ready says of resuming (set by the keeper)

    # What tests and tools read of the conversation
    @property
    def history(self) -> list[dict]:
        return self.core.history.messages()

    @property
    def eot_probabilities(self) -> list[float]:
        return self.core.eot_probabilities

    @property
    def _turn_audio(self) -> list[np.ndarray]:
        return self.core.heard.audio

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        """Greet the client. Nothing is taken from the engines until a spoken turn starts."""
        await self.send(P.session_ready(self.id, self.resume_fields))

    def restore(self, snap: Snapshot, generation: int, received: tuple[int | None, int | None]) -> None:
        self.core.restore(snap, generation, received)
        self._done_turn = self._seq_turn = snap.turn  # the turns before are over, whatever they had sent

    def in_flight(self) -> InFlight | None:
        return self._in_flight

    async def going_away(self, resume_token: str | None, reason: str) -> None:
        """The server stops serving this connection: a reply being sent ends here (response.done,
        interrupted) and the client is told where to go on."""
        await self.core.stop_replying()
        await self.send(P.going_away(resume_token, reason))

    async def send(self, msg: dict) -> None:
        if self.core.closed and msg.get("type") != "error":
            return
        async with self._send_lock:
            await self._send_raw(P.pack(msg))
        self.core.touch()

    @staticmethod
    def error_frame(code: str, message: str) -> bytes:
        """An error message for a connection refused before any session exists."""
        return P.pack(P.error(code, message))

    # ------------------------------------------------------------------ input
    async def on_frame(self, frame: bytes | str) -> None:
        """Handle one client frame. Bad input costs one ``error`` message, nothing more."""
        self.core.touch()
        try:
            msg = P.parse_client_frame(frame)
        except P.ProtocolError as exc:
            await self.send_error(exc.code, exc.message)
            return
        try:
            if isinstance(msg, P.AudioIn):
                await self.core.hear(msg.pcm)
            elif isinstance(msg, P.TextIn):
                await self.core.user_text(msg.text, overrides=self._checked(msg.response))
            elif isinstance(msg, P.TurnEnd):
                await self.core.end_turn(overrides=self._checked(msg.response))
            elif isinstance(msg, P.SessionUpdate):
                await self._updated(self.core.update(msg.settings))
            elif isinstance(msg, P.VoiceClip):
                await self._voice_clip(msg)
            elif isinstance(msg, P.ToolResult):
                await self._tool_result(msg)
        except BadSetting as exc:
            if self.cfg.on_error:
                self.cfg.on_error(P.E_BAD_SETTING)
            await self.send(P.error(P.E_BAD_SETTING, exc.message, V1_NAMES.get(exc.param, exc.param)))
        except Refusal as exc:  # the core's limits: a typed turn over the reply rate
            await self.core.error(exc.code, exc.message)

    def _checked(self, overrides: dict | None) -> dict | None:
        """A turn's reply settings, checked now (BadSetting before the turn ends, not after)."""
        if overrides:
            self.core.agent.updated(overrides, self.core.voices)
        return overrides

    async def _updated(self, settings) -> None:
        described = settings.describe()
        await self.send(P.session_updated({V1_NAMES.get(k, k): v for k, v in described.items()}))

    async def _voice_clip(self, msg: P.VoiceClip) -> None:
        """Pieces of the session's own reference clip; the last (done) one encodes it for the voice."""
        self._clip.append(msg.pcm)
        self._clip_samples += len(msg.pcm)
        if self._clip_samples > MAX_VOICE_CLIP_S * P.VOICE_CLIP_RATE:
            self._clip, self._clip_samples = [], 0
            raise BadSetting("voice.clip", f"a voice clip lasts at most {MAX_VOICE_CLIP_S:g} s; it is dropped")
        if not msg.done:
            return
        pcm, self._clip, self._clip_samples = np.concatenate(self._clip), [], 0
        if not len(pcm):
            raise BadSetting("voice.clip", "the voice clip has no audio")
        try:
            reference = await self.core.encode_voice_clip(pcm, msg.text)
        except EngineUnavailable as exc:
            await self.core.error(P.E_ENGINE_UNAVAILABLE, f"the voice clip could not be encoded ({exc})")
            return
        await self._updated(self.core.update({"voice_reference": reference}))

    async def _tool_result(self, msg: P.ToolResult) -> None:
        """A result goes to its pending call; the reply goes on with it (``respond``, the default)
        once every call of the reply has one. A result for a call the session does not wait on
        (unknown, cancelled, timed out, already answered) is ignored."""
        try:
            await self.core.tool_result(msg.call_id, msg.output, then="respond" if msg.respond else "close")
        except ToolResultError as exc:
            if exc.code == P.E_TOOL_RESULT_TOO_LARGE:
                await self.core.error(P.E_TOOL_RESULT_TOO_LARGE, exc.message)

    # ------------------------------------------------------------------ ConversationEvents
    async def speech(self, kind: str, audio_ms: float, item_id: str) -> None:
        await self.send(P.speech_event(kind, audio_ms))

    async def transcript_delta(self, turn: int, item_id: str, delta: str, text: str) -> None:
        await self.send(P.transcript_partial(text, turn))

    async def turn_ended(self, turn: int, item: Item, text: str, words: list[dict] | None) -> None:
        await self.send(P.transcript_final(text, turn, words))

    async def reply_started(self, reply: Reply) -> None:
        pass  # v1 has no message for it: the reply's text and audio carry the turn's number

    async def reply_text(self, reply: Reply, delta: str) -> None:
        await self.send(P.response_text(delta, reply.turn))

    async def reply_audio(self, reply: Reply, pcm: np.ndarray, seq: int) -> None:
        if reply.turn != self._seq_turn:
            self._seq_turn, self._seq = reply.turn, 0
        if self._in_flight is None or self._in_flight.item_id != reply.item_id:
            self._in_flight = InFlight(reply.turn, reply.item_id)
        self._in_flight.sent.append((self._seq, reply.samples + len(pcm)))
        await self.send(P.audio_out(pcm, reply.turn, self._seq))
        self._seq += 1

    async def reply_done(self, reply: Reply) -> None:
        if reply.turn <= self._done_turn:
            return  # the turn's response has ended already
        interrupted = reply.status == CANCELLED
        if not interrupted and self.core.awaiting_calls:
            self._open_turn = reply.turn  # it goes on once the tool results are in
            return
        await self._done(reply.turn, interrupted, None if interrupted else reply.marks)

    async def reply_paused(self, reply: Reply) -> None:
        await self.send(P.response_paused(reply.turn))

    async def reply_resumed(self, reply: Reply) -> None:
        await self.send(P.response_resumed(reply.turn))

    async def _done(self, turn: int, interrupted: bool, timings: dict | None = None) -> None:
        self._done_turn, self._open_turn = turn, None
        await self.send(P.response_done(turn, interrupted, timings))

    async def tool_call(self, reply: Reply, call: ToolCall, item: Item) -> None:
        await self.send(P.tool_call(call.call_id, call.name, call.arguments, reply.turn))

    async def tool_cancelled(self, call: ToolCall, turn: int, reason: str) -> None:
        await self.send(P.tool_cancelled(call.call_id, turn, reason))
        running = self.core.reply is not None and self.core.reply.running
        if reason == "cancelled" and self._open_turn == turn and not self.core.awaiting_calls and not running:
            await self._done(turn, interrupted=True)  # nothing plays: the waiting response ends here

    async def error(self, code: str, message: str) -> None:
        await self.send(P.error(code, message))
