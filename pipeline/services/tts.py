"""The TTS's service: many streams in one engine's batched step (a clause each, or one
utterance per reply fed word by word), and the Mimi encode."""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import AsyncIterator

import numpy as np

from pipeline import metrics
from pipeline.audio_constants import USER_RATE
from pipeline.engines import EngineBusy, Fed, UnknownStream, Voice
from pipeline.runtime.threads import InferenceThread

log = logging.getLogger(__name__)


def load_tts(cfg):
    if cfg.family == "dsm":
        from pipeline.tts.dsm.engine import DSMEngine as TTSEngine
    else:
        from pipeline.tts.engine import TTSEngine

    engine = TTSEngine(cfg)
    engine.warmup()
    return engine


class TTSService:
    """Text in, int16 24 kHz chunks out, for many streams at once (continuous batching).

    One stepping task drives the engine while any stream is open: each ``engine.step()`` (on the
    inference thread) admits a waiting stream and advances every stream with a slot by one frame;
    then the streams that advanced are woken. No lock is held across a clause or a pacing sleep;
    a consumer that stops early cancels its stream, which frees its slot before the next step.
    Stateless across requests: the conversation context comes with each request (the session
    owns it). An engine that takes words (DSM) also serves utterances, one per reply: ``open``,
    then ``feed`` its words as the LLM writes them and take the chunks made, until it has ended
    (``close``: cut short); their calls must reach this replica (the TTS deployment routes them
    by utterance id)."""

    def __init__(self, engine, thread: InferenceThread, unread_after_s: float = 10.0, label: str = "tts"):
        self.engine, self.thread = engine, thread
        self._wakeups: dict[object, asyncio.Event] = {}
        self._stepper: asyncio.Task | None = None
        self._failure: BaseException | None = None
        self._encoding = asyncio.Lock()
        self._utterances: dict[str, tuple[object, float]] = {}  # uid -> (its stream, when a call last touched it)
        self.unread_after_s = unread_after_s
        self._unseen = metrics.UNSEEN_SHAPES_AFTER_WARMUP.labels(deployment=label)
        self._unseen.inc(0)
        self._unseen_seen = engine.stats()["unseen_shape_calls"]
        self._busy = metrics.TTS_SLOTS_BUSY.labels(deployment=label)
        metrics.TTS_SLOTS.labels(deployment=label).set(engine.num_slots)
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

    async def feed(self, uid: str, pieces: list[tuple[str, bool]], final: bool = False, wait_s: float = 0.5) -> Fed:
        """Say ``pieces`` ((whole words, whether they begin a clause) each; ``final``: the utterance's
        text is all in) into utterance ``uid``, then give the chunks made since the last feed, waiting up to ``wait_s`` for the
        first one, unless the utterance waits for words (``Fed.hungry``: then nothing comes until
        more words do). One call in flight per utterance: its caller feeds again once this
        answers, with the words the LLM wrote meanwhile."""
        s = self._utterance(uid)
        self._utterances[uid] = (s, time.monotonic())
        if pieces or final:  # one hop to the inference thread for all of them
            await self.thread.run(self._say, s, [(str(t), bool(c)) for t, c in pieces] or [("", False)], final)
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

    def _say(self, s, pieces: list[tuple[str, bool]], final: bool) -> None:
        for i, (text, clause) in enumerate(pieces):
            self.engine.say(s, text, final and i == len(pieces) - 1, clause)

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
                self._cancel_soon(s)

    def _cancel_soon(self, s) -> None:
        """End ``s`` on the inference thread (queued before any later step), then step on. No task
        awaits it: a stream left as its event loop shuts down (a generator finalised then) leaves
        no cancel pending."""
        loop = asyncio.get_running_loop()

        def step_on(done) -> None:
            if not done.cancelled() and done.exception() is not None:
                log.error("TTS cancel failed", exc_info=done.exception())
            with contextlib.suppress(RuntimeError):  # the loop has closed meanwhile: nothing to step
                loop.call_soon_threadsafe(self._ensure_stepping)

        self.thread.submit(self.engine.cancel, s).add_done_callback(step_on)

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
