"""One reply: the LLM's text, split into clauses, spoken by the TTS clause by clause, and the audio
sent paced to a small lead over real time.

A :class:`Reply` owns its queues (clauses waiting for the TTS, chunks waiting to be sent), its
tasks and its timings. It knows no wire format: what it makes goes to its host (the
conversation) as text deltas, audio chunks and, once, its end. Cancelling its task stops it at
its next await: nothing more is sent, and its engine streams are closed before the cancellation
goes on.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Callable, Protocol

import numpy as np

from pipeline.conversation.agent import AgentSettings
from pipeline.audio_constants import REPLY_RATE
from pipeline.conversation.clauses import ClauseSplitter
from pipeline.conversation.dead_air import CLIENT, ENGINE_UNAVAILABLE, DeadAir
from pipeline.conversation.synthesis import synthesize
from pipeline.conversation.observer import Observer
from pipeline.engines import (Backends, ClientGone, EngineBusy, EngineUnavailable, LLMFinish, Segment,
                              ToolCall, Voice, bounded_stream)
from pipeline.errors import E_ENGINE_UNAVAILABLE, E_INTERNAL, E_SERVER_BUSY
from pipeline.conversation.history import new_id
from pipeline.session_config import SessionConfig

log = logging.getLogger(__name__)

# Reply statuses (the Realtime protocol's names): how a reply ended.
IN_PROGRESS, COMPLETED, CANCELLED, INCOMPLETE, FAILED = "in_progress", "completed", "cancelled", "incomplete", "failed"


class ReplyHost(Protocol):
    """What a reply needs from its conversation."""

    cfg: SessionConfig
    backends: Backends
    clock: Callable[[], float]
    observer: Observer  # pipeline/conversation/observer.py

    def tts_context(self) -> list[Segment]: ...  # the conversation's TTS context now
    def reply_voice(self, reply: "Reply") -> Voice | None: ...  # the voice of the reply's next clause
    async def reply_text(self, reply: "Reply", delta: str) -> None: ...
    async def reply_tool_call(self, reply: "Reply", call: ToolCall) -> None: ...
    async def reply_audio(self, reply: "Reply", pcm: np.ndarray, seq: int) -> None: ...
    async def reply_error(self, reply: "Reply", code: str, message: str) -> None: ...
    async def reply_ended(self, reply: "Reply") -> None: ...  # ran to its end (also after an error)


class Reply:
    def __init__(self, host: ReplyHost, turn: int, messages: list[dict] | None, settings: AgentSettings,
                 ended_at: float, encoding: asyncio.Task | None = None, overrides: dict | None = None,
                 script: str | None = None, record: bool = True, ahead=None, metadata=None,
                 speech_end: float | None = None):
        self.host = host
        self.metadata = metadata  # the client's own (a Realtime response.create's), carried to its events
        self.turn = turn
        self.id = new_id("resp")
        self.item_id = new_id("item")  # the assistant item it adds to the history
        self.messages = messages  # None: nothing to answer (an empty turn); it ends at once
        self.settings = settings  # the session's settings with this reply's overrides, at its start
        self.overrides = overrides or {}  # the settings this reply chose for itself
        self.script = script  # a fixed text to speak instead of the LLM's (a tool call's filler or timeout)
        self.ahead = ahead  # its start, made ahead of the turn's end (pipeline/conversation/speculation.py), if any
        self.record = record  # what it says joins the history (a filler does not)
        self.calls: list[ToolCall] = []  # the tool calls the LLM made (the first one ends the speaking)
        self.ended_at = ended_at  # when the user's turn ended (time to first audio is counted from it)
        self.speech_end = speech_end  # when the user's speech ended (voice-to-voice); None: no speech
        self.air = DeadAir(host.clock, host.observer.dead_air)  # gaps in its audio, and their causes
        self.encoding = encoding  # the user's audio joining the TTS context; awaited before the first clause
        self.status = IN_PROGRESS
        self.reason: str | None = None  # why it was cancelled or incomplete
        self.text = ""  # everything the LLM wrote
        # The clause the LLM is writing, its text so far (its clauses before it are on the queue), and
        # an event set whenever either changes: a TTS that takes words is fed from them.
        self.writing = ""
        self.wrote = asyncio.Event()
        self.spoken: list[tuple[int, str]] = []  # (first sample, clause) of each clause whose audio was sent
        self.samples = 0  # audio samples sent
        self.codes: list[np.ndarray] = []  # codes of the audio sent
        self.first_audio_at: float | None = None
        self.usage: tuple[int, int] | None = None  # (prompt, completion) tokens, where the LLM told
        self.marks: dict[str, float] = {}  # ms after the reply started: llm_first_token, first_clause, first_audio
        self.played: int | None = None  # samples the client reports it played (None: not reported)
        self.barge_in_s: float | None = None  # speech over its audio began this long before it stopped
        self.done_sent = False
        self.remembered = False  # its history item has been added
        self.task: asyncio.Task | None = None
        # Paused (speech over it that may be no turn): nothing is sent until resumed; its text and
        # audio go on being made into its own queues meanwhile.
        self._playing = asyncio.Event()
        self._playing.set()
        self._paused_at: float | None = None

    @property
    def paused(self) -> bool:
        return not self._playing.is_set()

    def pause(self) -> None:
        if not self.paused:
            self._paused_at = self.host.clock()
            self._playing.clear()

    def resume(self) -> None:
        """Send again from where it paused; the pace clock skips the pause (no burst to catch up)."""
        if self.paused:
            if self.first_audio_at is not None:
                self.first_audio_at += self.host.clock() - self._paused_at
            self._paused_at = None
            self._playing.set()

    def start(self) -> None:
        self.task = asyncio.create_task(self._run(), name=f"reply-{self.id}")

    @property
    def running(self) -> bool:
        return self.task is not None and not self.task.done()

    @property
    def said(self) -> str:
        """The text whose audio was sent."""
        return " ".join(clause for _, clause in self.spoken)

    @property
    def transcript(self) -> str:
        """What the history keeps of it: a cut reply, what was said (heard, where the client reports
        what it played); else all the LLM wrote."""
        if self.status != CANCELLED:
            return self.text.strip()
        played = self.samples if self.played is None else self.played
        return " ".join(clause for start, clause in self.spoken if start < played)

    # ------------------------------------------------------------------ text
    async def _run(self) -> None:
        try:
            await self._reply()
        finally:
            if self.ahead is not None and self.ahead.first is not None:
                await self.ahead.first.cancel()  # a first clause made ahead that was not taken

    async def _reply(self) -> None:
        if self.messages is not None:
            try:
                await self._generate()
            except asyncio.CancelledError:
                raise
            except ClientGone:  # the client left: the session is closing, nothing to tell anyone
                self.status, self.reason = FAILED, "client_gone"
                return
            except EngineBusy as exc:  # no TTS slot now: this reply ends, the session goes on
                log.warning("reply %s (turn %d) refused: %s", self.id, self.turn, exc)
                self.status, self.reason = FAILED, E_SERVER_BUSY
                await self.host.reply_error(self, E_SERVER_BUSY,
                                            f"reply to turn {self.turn} refused: the server is busy ({exc})")
            except EngineUnavailable as exc:  # a dead or stalled replica ends this reply, not the session
                log.warning("reply %s (turn %d) cut short: %s", self.id, self.turn, exc)
                if self.first_audio_at is not None:  # its audio stops here: silence until the next reply
                    self.air.check(self._runs_out(), self.host.clock(), self._sent_ms(), ENGINE_UNAVAILABLE)
                self.status, self.reason = FAILED, E_ENGINE_UNAVAILABLE
                await self.host.reply_error(self, E_ENGINE_UNAVAILABLE,
                                            f"reply to turn {self.turn} cut short: an engine is unavailable ({exc})")
            except Exception as exc:  # noqa: BLE001 - a backend fault ends this reply only
                log.exception("reply %s (turn %d) failed", self.id, self.turn)
                self.status, self.reason = FAILED, E_INTERNAL
                await self.host.reply_error(self, E_INTERNAL, f"reply to turn {self.turn} failed: {type(exc).__name__}")
        if self.status == IN_PROGRESS and self.paused:
            await self._playing.wait()  # a paused reply ends once it resumes (a cut cancels it here)
        if self.status == IN_PROGRESS:
            self.status = COMPLETED
        await self.host.reply_ended(self)

    async def _generate(self) -> None:
        # Over 40 lines as one function: the LLM stream's one loop (text, tool calls, its end) and the state it keeps.
        host, cfg = self.host, self.host.cfg
        started = host.clock()
        clauses: asyncio.Queue[str | None] = asyncio.Queue()
        speaker = asyncio.create_task(self._speak(clauses, started)) if self.settings.speaks else None
        try:
            splitter = ClauseSplitter(max_words=cfg.clause_max_words)
            if self.script is not None:
                llm = _scripted(self.script)
            elif self.ahead is not None:
                llm = self.ahead.stream()
            else:
                llm = host.backends.llm_stream(self.messages, sampling=self.settings.sampling())
            # aclosing: a cancelled reply closes the engine stream before the cancellation goes on (its
            # clean-up is queued on the inference thread by then), not whenever the collector finds it.
            async with contextlib.aclosing(bounded_stream(llm, cfg.engine_timeout_s)) as deltas:
                async for delta in deltas:
                    if isinstance(delta, LLMFinish):
                        if delta.reason == "length" and self.settings.max_output_tokens is not None:
                            # the client's limit cut it (the server's own cap is a reply's normal length)
                            self.status, self.reason = INCOMPLETE, "max_output_tokens"
                        if delta.prompt_tokens is not None and delta.completion_tokens is not None:
                            self.usage = (delta.prompt_tokens, delta.completion_tokens)
                        continue
                    if isinstance(delta, ToolCall):
                        if not self.calls:  # a call ends the speaking: what came before it is said
                            for clause in splitter.flush():
                                clauses.put_nowait(clause)
                            self._written("")
                        self.calls.append(delta)
                        await host.reply_tool_call(self, delta)
                        continue
                    if not delta or self.calls:
                        continue
                    if not self.text:
                        self.mark("llm_first_token_ms", started)
                    self.text += delta
                    await host.reply_text(self, delta)
                    for clause in splitter.push(delta):
                        self.mark("first_clause_ms", started)
                        clauses.put_nowait(clause)
                    self._written(splitter.pending)
            for clause in splitter.flush():
                self.mark("first_clause_ms", started)
                clauses.put_nowait(clause)
            clauses.put_nowait(None)
            self._written("")
            if speaker is not None:
                await speaker
        except BaseException as exc:
            if speaker is not None:
                speaker.cancel()
                await asyncio.gather(speaker, return_exceptions=True)
            if isinstance(exc, asyncio.CancelledError) and self.encoding is not None:
                self.encoding.cancel()
            raise

    def _written(self, pending: str) -> None:
        self.writing = pending
        self.wrote.set()

    def mark(self, name: str, started: float) -> None:
        self.marks.setdefault(name, 1000 * (self.host.clock() - started))

    def _runs_out(self) -> float:
        """When the audio sent so far has played out at the client (pauses skipped)."""
        return self.first_audio_at + self.samples / REPLY_RATE

    def _sent_ms(self) -> float:
        return 1000 * self.samples / REPLY_RATE

    # ------------------------------------------------------------------ audio
    async def _speak(self, clauses: asyncio.Queue, started: float) -> None:
        """Send the reply's audio, paced to ``pace_lead_s`` ahead of real time, while
        :meth:`_synthesize` makes it as fast as the TTS goes: the next clause's synthesis starts
        when the previous clause is made, not when it has been played, so a clause boundary is
        never dead air while the TTS runs faster than real time."""
        # Over 40 lines as one function: the pacing loop and the state it keeps between chunks.
        host, cfg = self.host, self.host.cfg
        chunks: asyncio.Queue = asyncio.Queue()  # bounded by the reply: its clauses' frames
        synthesis = asyncio.create_task(synthesize(self, clauses, chunks, started))
        seq = 0
        last_at = None
        try:
            while (item := await chunks.get()) is not None:
                clause, pcm, codes = item
                if self.paused:
                    await self._playing.wait()
                    last_at = None  # the pause is not a gap between chunks
                now = host.clock()
                if self.first_audio_at is None:
                    self.first_audio_at = now
                    self.mark("first_audio_ms", started)
                    host.observer.first_audio(now - self.ended_at)
                    if self.speech_end is not None:
                        host.observer.voice_to_voice(now - self.speech_end)
                elif cfg.pace_lead_s is not None:
                    ahead = self.samples / REPLY_RATE - (now - self.first_audio_at)
                    if ahead > cfg.pace_lead_s:
                        await asyncio.sleep(ahead - cfg.pace_lead_s)
                    if self.paused:  # paused while it waited to send
                        await self._playing.wait()
                        last_at = None
                now = host.clock()
                if last_at is not None:
                    host.observer.chunk_gap(now - last_at)
                    # the client's playback ran dry, if it did, and starts again with this chunk
                    self.first_audio_at += self.air.check(self._runs_out(), now, self._sent_ms())
                last_at = now
                if clause is not None:  # the first chunk of a clause: it starts playing now (not before
                    self.spoken.append((self.samples, clause))  # the pace's wait: cut there, it was never said)
                self.air.stages.wait("sender", CLIENT)
                await host.reply_audio(self, pcm, seq)
                self.air.stages.done("sender")
                self.codes.append(codes)
                seq += 1
                self.samples += len(pcm)
            await synthesis  # raises what ended the synthesis early (e.g. EngineUnavailable)
        finally:
            synthesis.cancel()
            await asyncio.gather(synthesis, return_exceptions=True)


async def _scripted(text: str):
    """A fixed text as an LLM stream would bring it."""
    yield text
