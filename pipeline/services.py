"""Async services around the engines: what a deployment serves, without the framework.

Each service owns an engine and the one :class:`InferenceThread` that runs all its model
calls. Ray deployments (``deployments/``) are thin adapters over these; :class:`LocalBackends`
wires them in-process for tests and tools that run without Ray.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import TYPE_CHECKING, AsyncIterator

import numpy as np

from pipeline import metrics
from pipeline.runtime.threads import InferenceThread
from pipeline.audio_constants import USER_RATE
from pipeline.engines import Backends, EngineBusy, Fed, LLMFinish, NoFreeSlot, Sampling, Segment, ToolCall, UnknownStream, Voice
from pipeline.llm.tool_calls import ToolCallParser

if TYPE_CHECKING:
    from pipeline.stt.engine import STTEvent

log = logging.getLogger(__name__)


def load_stt(cfg):
    """Build and warm the STT engine (call on the inference thread that will serve it)."""
    from pipeline.stt.engine import STTEngine

    engine = STTEngine.from_config(cfg)
    engine.warmup()
    return engine


def load_llm(cfg):
    from pipeline.llm import make_llm

    engine = make_llm(cfg)
    engine.warmup()
    return engine


def load_tts(cfg):
    if cfg.family == "dsm":
        from pipeline.tts.dsm.engine import DSMEngine as TTSEngine
    else:
        from pipeline.tts.engine import TTSEngine

    engine = TTSEngine(cfg)
    engine.warmup()
    return engine


class STTService:
    """Many sessions' streams in one engine; every due chunk advances in one batched step.

    A stream is one spoken turn: ``open`` takes a slot, ``finish`` returns the turn's transcript
    and gives the slot back in the same round trip, ``close`` gives it back without one.

    A call for a stream this service does not hold raises :class:`UnknownStream` (counted: with
    sticky routing it means a misroute or a replaced replica). Opening an open stream id restarts
    it (its caller gave up on the old one, e.g. after a timeout). A stream no call has touched for
    ``stale_after_s`` is abandoned (its session's calls now reach another replica) and is closed
    when a new stream needs its slot."""

    def __init__(self, engine, thread: InferenceThread, stale_after_s: float = 120.0, replica: str = ""):
        self.engine, self.thread = engine, thread
        self.stale_after_s = stale_after_s
        self.replica = replica  # label of this replica's metrics
        # Events waiting for their stream's next push; a key exists exactly while the stream is open,
        # so a step that finishes after its stream closed leaves nothing behind.
        self._outbox: dict[str, list[dict]] = {}
        self._last_call: dict[str, float] = {}  # stream id -> monotonic time of its last call
        self._finals: dict[str, "STTEvent"] = {}  # an ended stream's final event, until finish takes it
        self._step_lock = asyncio.Lock()

    async def open(self, sid: str, language: str | None = None) -> str | None:
        """Take a slot for a spoken turn heard as ``language`` (None: the model's default); returns
        None, or the reason it could not. A language the model does not speak raises ValueError."""
        if sid in self._outbox:
            await self.close(sid)
        # Noted before the engine call: an open whose caller gave up (cancelled midway, after the
        # engine took the slot) is still closed by the stale sweep.
        self._last_call[sid] = time.monotonic()
        for retry in (False, True):  # once more after closing abandoned streams, if there were any
            try:
                await self.thread.run(self.engine.open, sid, language)
                break
            except NoFreeSlot as exc:
                if retry or not await self._close_stale():
                    self._last_call.pop(sid, None)
                    return str(exc)
        self._outbox[sid] = []
        self._last_call[sid] = time.monotonic()
        metrics.STT_STREAMS_OPENED.labels(replica=self.replica).inc()
        self._export_active()
        return None

    async def _close_stale(self) -> int:
        now = time.monotonic()
        stale = [sid for sid, t in self._last_call.items() if now - t > self.stale_after_s]
        for sid in stale:
            log.warning("STT stream %s untouched for %.0f s: closing it", sid, now - self._last_call[sid])
            await self.close(sid)
        return len(stale)

    def _known(self, sid: str) -> None:
        if sid not in self._outbox:
            metrics.STT_UNKNOWN_STREAMS.labels(replica=self.replica).inc()
            raise UnknownStream(f"this STT replica holds no stream {sid!r}")
        self._last_call[sid] = time.monotonic()

    async def push(self, sid: str, pcm: np.ndarray) -> list[dict]:
        """Buffer int16 audio for a stream, run the steps now due, return its events."""
        self._known(sid)
        audio = np.ascontiguousarray(pcm, dtype=np.float32) / 32768.0
        await self.thread.run(self.engine.feed, sid, audio)
        await self._drain()
        events = self._outbox.get(sid) or []
        if events:
            self._outbox[sid] = []
        return events

    async def _drain(self) -> None:
        # Whoever holds the lock steps for every stream; events wait in each open stream's outbox.
        async with self._step_lock:
            while await self.thread.run(self.engine.pending):
                t0 = time.perf_counter()
                events = await self.thread.run(self.engine.step)
                metrics.STT_STEP.observe(time.perf_counter() - t0)
                for ev in events:
                    outbox = self._outbox.get(ev.stream_id)
                    if outbox is None:  # closed while this step ran: nobody will collect them
                        continue
                    if ev.kind == "final":
                        self._finals[ev.stream_id] = ev
                    else:
                        outbox.append({"kind": ev.kind, "text": ev.text})

    async def finish(self, sid: str) -> tuple[str, list[dict]]:
        """The turn's final text and its words with times (ms from the turn's first recognised
        audio). The turn's last chunk is decoded in the same batched steps as other streams'
        chunks; the slot is free again when this returns, even if decoding failed."""
        self._known(sid)
        try:
            await self.thread.run(self.engine.end, sid)
            await self._drain()  # steps until nothing is due: the stream's final came in one of them
            final = self._finals.pop(sid, None)
            if final is None:
                raise RuntimeError(f"STT stream {sid!r} ended without a final transcript")
            return final.text, final.words
        finally:
            self._outbox.pop(sid, None)
            self._finals.pop(sid, None)
            self._last_call.pop(sid, None)
            await self.thread.run(self.engine.close, sid)
            self._export_active()

    async def peek(self, sid: str) -> tuple[str, list[dict]] | None:
        """The transcript and words ``finish`` would give now, while the stream stays open for more
        audio: the stream is copied into a spare slot (STTEngine.fork), which is ended and freed.
        None when no slot is spare (nothing else changes)."""
        self._known(sid)
        fork = f"{sid}#peek"
        try:
            await self.thread.run(self.engine.fork, sid, fork)
        except NoFreeSlot:
            return None
        self._outbox[fork] = []
        try:
            await self.thread.run(self.engine.end, fork)
            await self._drain()
            final = self._finals.pop(fork, None)
            return None if final is None else (final.text, final.words)
        finally:
            self._outbox.pop(fork, None)
            self._finals.pop(fork, None)
            await self.thread.run(self.engine.close, fork)

    async def close(self, sid: str) -> None:
        """Give the slot back without a transcript (session gone); closing twice is harmless."""
        self._outbox.pop(sid, None)
        self._finals.pop(sid, None)
        self._last_call.pop(sid, None)
        await self.thread.run(self.engine.close, sid)
        self._export_active()

    def _export_active(self) -> None:
        metrics.STT_ACTIVE_STREAMS.set(len(self.engine.active_streams))

    def stats(self) -> dict:
        """Open streams (one slot each) and the engine's slot count (what autoscaling reads)."""
        return {"active_streams": len(self.engine.active_streams), "slots": self.engine.num_slots}


def _finish(stream) -> LLMFinish | None:
    """Why a model engine's stream stopped, with its token counts (read on the inference thread)."""
    reason = getattr(stream, "finish_reason", None)
    if reason not in ("stop", "length"):
        return None
    prompt, generated = getattr(stream, "prompt_ids", None), getattr(stream, "generated", None)
    return LLMFinish(reason, None if prompt is None else len(prompt), None if generated is None else len(generated))


class LLMService:
    """Streams of one LLM engine: a model engine (``stream``) steps on the inference thread, an
    HTTP engine (``astream``) waits on the event loop, so a slow upstream holds up no other stream."""

    def __init__(self, engine, thread: InferenceThread):
        self.engine, self.thread = engine, thread

    async def stream(self, messages: list[dict], sampling: Sampling = Sampling()
                     ) -> AsyncIterator[str | ToolCall | LLMFinish]:
        """Text deltas and tool calls of the reply to ``messages``, sampled as ``sampling``, then an
        :class:`LLMFinish` where the engine tells why it stopped. A model engine writes calls in its
        own text; they are parsed out here (``pipeline.llm.tool_calls``), so the text before a call
        streams on as it comes.

        Closing or cancelling this generator closes the engine's stream at once (the model's on
        the inference thread), not whenever the garbage collector finds it."""
        t0 = time.perf_counter()
        first = True
        parser = ToolCallParser() if sampling.tools and not hasattr(self.engine, "astream") else None
        async with contextlib.aclosing(self._deltas(messages, sampling)) as deltas:
            async for delta in deltas:
                if first:
                    metrics.LLM_TIME_TO_FIRST_TOKEN.observe(time.perf_counter() - t0)
                    first = False
                if parser is None:
                    yield delta
                    continue
                for item in parser.push(delta) if isinstance(delta, str) else [*parser.flush(), delta]:
                    yield item
            for item in parser.flush() if parser is not None else ():  # a stream that ended without LLMFinish
                yield item

    def _deltas(self, messages: list[dict], sampling: Sampling) -> AsyncIterator[str | ToolCall | LLMFinish]:
        if hasattr(self.engine, "astream"):
            return self.engine.astream(messages, sampling)
        return self.thread.iterate(self.engine.stream, messages, sampling, last=_finish)

    def stats(self) -> dict:
        return {"active_requests": self.engine.active_requests}


class TTSService:
    """Text in, int16 24 kHz chunks out, for many streams at once (continuous batching).

    One stepping task drives the engine while any stream is open: each ``engine.step()`` (on the
    inference thread) admits a waiting stream and advances every stream with a slot by one frame;
    then the streams that advanced are woken. No lock is held across a clause or a pacing sleep;
    a consumer that stops early cancels its stream, which frees its slot before the next step.
    Stateless across requests: the conversation context comes with each request (the session
    owns it). An engine that takes words (DSM) also serves utterances, one per reply: ``open``,
    ``say`` each clause as the LLM writes it, ``chunks``; their calls must reach this replica
    (the TTS deployment routes them by utterance id)."""

    def __init__(self, engine, thread: InferenceThread, unread_after_s: float = 10.0):
        self.engine, self.thread = engine, thread
        self._wakeups: dict[object, asyncio.Event] = {}
        self._stepper: asyncio.Task | None = None
        self._failure: BaseException | None = None
        self._encoding = asyncio.Lock()
        self._utterances: dict[str, tuple[object, float]] = {}  # uid -> (its stream, when a call last touched it)
        self._cancelling: set[asyncio.Task] = set()
        self.unread_after_s = unread_after_s
        self._unseen = metrics.UNSEEN_SHAPES_AFTER_WARMUP.labels(deployment="tts")
        self._unseen.inc(0)
        self._unseen_seen = engine.stats()["unseen_shape_calls"]
        self._busy = metrics.TTS_SLOTS_BUSY.labels(deployment="tts")
        metrics.TTS_SLOTS.labels(deployment="tts").set(engine.num_slots)
        self._busy.set(0)

    def _count_unseen_shapes(self) -> None:
        """Export the engine's count of calls with shapes warm-up did not cover (new ones only)."""
        now = self.engine.stats()["unseen_shape_calls"]
        if now > self._unseen_seen:
            self._unseen.inc(now - self._unseen_seen)
        self._unseen_seen = now

    async def _run_steps(self) -> None:
        """Step the engine while it has streams; wake each stream that advanced."""
        try:
            while self.engine.has_work():
                advanced = await self.thread.run(self.engine.step)
                for s in advanced:
                    wake = self._wakeups.get(s)
                    if wake is not None:
                        wake.set()
                self._count_unseen_shapes()
                self._busy.set(self.engine.busy_slots)
        except Exception as exc:  # noqa: BLE001 - every open stream learns of it
            log.exception("TTS step failed")
            self._failure = exc
            for wake in self._wakeups.values():
                wake.set()
        finally:
            self._stepper = None
            self._busy.set(self.engine.busy_slots)

    def _ensure_stepping(self) -> None:
        if self._stepper is None:
            self._failure = None
            self._stepper = asyncio.create_task(self._run_steps(), name="tts-steps")

    async def stream(self, text: str, context: list | None = None, voice: Voice | None = None
                     ) -> AsyncIterator[tuple[np.ndarray, np.ndarray]]:
        """(int16 chunk, codes [n, 32] of the frames that made it) for ``text`` spoken after ``context``
        in ``voice`` (None: the default voice; a name the engine lacks raises KeyError)."""
        t0 = time.perf_counter()
        profile = self._profile(voice)
        s = await self.thread.open(self.engine.stream, text, self.engine.voices.context(profile, context),
                                   profile.speaker, reference=profile.reference)
        async for _, pcm, codes in self._chunks_of(s, t0):
            yield pcm, codes

    def _profile(self, voice: Voice | None):
        return self.engine.voices.voice(voice.name, voice.reference) if voice is not None else self.engine.voices.voice()

    @property
    def takes_words(self) -> bool:
        """The engine takes one stream per reply, its clauses as they come (DSM): :meth:`open`."""
        return hasattr(self.engine, "say")

    async def open(self, uid: str, voice: Voice | None = None) -> None:
        """Open utterance ``uid`` (one reply's speech) in ``voice``: its clauses go in and its audio
        comes out by :meth:`feed`. Reopening an open id restarts it. Utterances nobody reads and no
        call touched for ``unread_after_s`` (their reply gone before it read them) are closed here,
        where a new one may need their rows."""
        if not self.takes_words:
            raise NotImplementedError("this TTS takes a clause per stream (tts_stream), not an utterance")
        now = time.monotonic()
        for old, (s, touched) in list(self._utterances.items()):
            if old == uid or (now - touched > self.unread_after_s and s not in self._wakeups):
                del self._utterances[old]
                await self.thread.run(self.engine.cancel, s)
        if len(self._utterances) >= self.engine.num_slots + self.engine.cfg.max_waiting:
            raise EngineBusy(f"{len(self._utterances)} utterances are open on this TTS replica")
        profile = self._profile(voice)
        self._utterances[uid] = (await self.thread.open(self.engine.open, profile.speaker, profile.reference), now)
        self._ensure_stepping()

    async def feed(self, uid: str, clauses: list[str], final: bool = False, wait_s: float = 0.5) -> Fed:
        """Say ``clauses`` (whole words; ``final``: the utterance's text is all in) into utterance
        ``uid``, then give the chunks made since the last feed, waiting up to ``wait_s`` for the
        first one, unless the utterance waits for words (``Fed.hungry``: then nothing comes until
        more clauses do). One call in flight per utterance: its caller feeds again once this
        answers, with the clauses the LLM wrote meanwhile."""
        s = self._utterance(uid)
        self._utterances[uid] = (s, time.monotonic())
        if clauses or final:  # one hop to the inference thread for all of them
            await self.thread.run(self._say, s, clauses, final)
        wake = self._wakeups[s] = asyncio.Event()
        chunks: list = []
        try:
            self._ensure_stepping()
            async with asyncio.timeout(wait_s):
                while True:
                    wake.clear()
                    ended, hungry = s.finished, self.engine.hungry(s)  # read before taking, as in _chunks_of
                    while (item := s.take_marked()) is not None:
                        chunks.append(item)
                    if chunks or ended or hungry:
                        break
                    if self._failure is not None:
                        raise RuntimeError("TTS engine step failed") from self._failure
                    await wake.wait()
        except TimeoutError:
            ended = hungry = False
        finally:
            self._wakeups.pop(s, None)
        if ended:
            self._utterances.pop(uid, None)
        return Fed(chunks, ended, hungry and not ended)

    def _say(self, s, clauses: list[str], final: bool) -> None:
        for i, clause in enumerate(clauses or [""]):
            self.engine.say(s, clause, final and i == max(len(clauses), 1) - 1)

    async def close(self, uid: str) -> None:
        """End utterance ``uid`` now (its reply was cut short), freeing its row; idempotent."""
        s, _ = self._utterances.pop(uid, (None, None))
        if s is not None and not s.finished:
            await self._cancel(s)

    def _utterance(self, uid: str):
        try:
            return self._utterances[uid][0]
        except KeyError:
            raise UnknownStream(f"no open utterance {uid!r} on this TTS replica") from None

    async def _chunks_of(self, s, t0: float) -> AsyncIterator[tuple[int | None, np.ndarray, np.ndarray]]:
        """A stream's chunks as the step loop publishes them; closed early when left early."""
        wake = self._wakeups[s] = asyncio.Event()
        samples = 0
        try:
            self._ensure_stepping()
            while True:
                # Cleared before looking: a step that ends after this (even while the consumer holds a
                # yielded chunk) sets it again, so the wait below never misses one.
                wake.clear()
                ended = s.finished  # read before taking: chunks are published before `finished`
                while (item := s.take_marked()) is not None:
                    if samples == 0:
                        metrics.TTS_TIME_TO_FIRST_CHUNK.observe(time.perf_counter() - t0)
                    samples += len(item[1])
                    yield item
                if ended:
                    break
                if self._failure is not None:
                    raise RuntimeError("TTS engine step failed") from self._failure
                await wake.wait()
            if samples:
                metrics.TTS_REAL_TIME_FACTOR.observe((time.perf_counter() - t0) / (samples / self.engine.sample_rate))
        finally:
            self._wakeups.pop(s, None)
            if not s.finished:  # stopped early: free the slot on the inference thread, before the next step
                task = asyncio.get_running_loop().create_task(self._cancel(s))
                self._cancelling.add(task)
                task.add_done_callback(self._cancelling.discard)

    async def _cancel(self, s) -> None:
        """End ``s`` on the inference thread; then the row it freed may take a waiting stream."""
        await self.thread.run(self.engine.cancel, s)
        self._ensure_stepping()

    async def encode(self, pcm: np.ndarray, rate: int = USER_RATE) -> np.ndarray:
        """Audio (int16 at ``rate``: a user turn at 16 kHz, a voice clip at 24 kHz) to Mimi codes
        [T, 32], once, for the context: a piece of the largest bucket per call on the inference
        thread, so the streams' frame steps run between the pieces of a long turn (one at a time:
        the encoder's streaming state is one)."""
        async with self._encoding:
            pieces = self.engine.encoder.audio_pieces(pcm, rate)
            try:
                while (codes := await self.thread.run(next, pieces)) is None:
                    pass  # the step loop's next frame step runs here, if any stream is open
            finally:  # cancelled between pieces: the streaming state closed where it runs
                await asyncio.shield(self.thread.run(pieces.close))
        self._count_unseen_shapes()
        return codes

    def stats(self) -> dict:
        """Open streams (with a slot, or waiting for one) and the engine's slot count."""
        return {"active_requests": self.engine.active_requests, "slots": self.engine.num_slots}


class LocalBackends(Backends):
    """The session's :class:`~pipeline.engines.Backends` over in-process services (no Ray); its
    twin over Ray deployment handles is ``deployments.gateway.RayBackends``."""

    def __init__(self, stt: STTService, llm: LLMService, tts: TTSService):
        self.stt, self.llm, self.tts = stt, llm, tts
        self.tts_words = tts.takes_words

    @classmethod
    def build(cls, stt_cfg, llm_cfg, tts_cfg) -> "LocalBackends":
        """Load and warm the three engines, each on its own inference thread."""
        services = []
        for name, load, svc in (("stt", load_stt, STTService), ("llm", load_llm, LLMService), ("tts", load_tts, TTSService)):
            thread = InferenceThread(name)
            services.append(svc(thread.call(load, {"stt": stt_cfg, "llm": llm_cfg, "tts": tts_cfg}[name]), thread))
        return cls(*services)

    async def stt_open(self, sid: str, language: str | None = None) -> None:
        reason = await self.stt.open(sid, language)
        if reason:
            raise NoFreeSlot(reason)

    async def stt_push(self, sid: str, pcm: np.ndarray) -> list[dict]:
        return await self.stt.push(sid, pcm)

    async def stt_finish(self, sid: str) -> tuple[str, list[dict]]:
        return await self.stt.finish(sid)

    async def stt_peek(self, sid: str) -> tuple[str, list[dict]] | None:
        return await self.stt.peek(sid)

    async def stt_close(self, sid: str) -> None:
        await self.stt.close(sid)

    def llm_stream(self, messages: list[dict], sampling: Sampling) -> AsyncIterator[str | ToolCall | LLMFinish]:
        return self.llm.stream(messages, sampling)

    def tts_stream(self, text: str, context: list[Segment], voice: Voice | None = None
                   ) -> AsyncIterator[tuple[np.ndarray, np.ndarray]]:
        return self.tts.stream(text, context, voice)

    async def tts_encode(self, pcm: np.ndarray, rate: int = USER_RATE) -> np.ndarray:
        return await self.tts.encode(pcm, rate)

    async def tts_open(self, uid: str, voice: Voice | None = None) -> None:
        await self.tts.open(uid, voice)

    async def tts_feed(self, uid: str, clauses: list[str], final: bool = False) -> Fed:
        return await self.tts.feed(uid, clauses, final)

    async def tts_close(self, uid: str) -> None:
        await self.tts.close(uid)
