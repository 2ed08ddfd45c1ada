"""The session's engines through Ray Serve's deployment handles (the gateway's Backends)."""
import functools
from typing import AsyncIterator

import numpy as np
from ray import exceptions as ray_errors
from ray.serve import exceptions as serve_errors
from ray.serve.handle import DeploymentHandle

from pipeline.audio_constants import USER_RATE
from pipeline.engines import (Backends, EngineUnavailable, Fed, LLMFinish, NoFreeSlot, Sampling, Segment, ToolCall,
                              Voice, WordVoices)

# What Ray raises when the replica serving a call is gone or cannot be reached: the session
# tells its client engine_unavailable (and carries on), never internal.
REPLICA_GONE = (ray_errors.RayActorError, ray_errors.ActorUnavailableError, ray_errors.NodeDiedError,
                ray_errors.WorkerCrashedError, ray_errors.ObjectLostError, ray_errors.OwnerDiedError,
                serve_errors.DeploymentUnavailableError, serve_errors.BackPressureError)


def _engine_call(method):
    """A Backends method whose replica may die under it: Ray's errors become EngineUnavailable."""

    @functools.wraps(method)
    async def call(*args, **kwargs):
        try:
            return await method(*args, **kwargs)
        except REPLICA_GONE as exc:
            raise EngineUnavailable(f"{type(exc).__name__}: the replica is gone") from None

    return call


async def _remote_stream(gen) -> AsyncIterator:
    """Iterate a streaming handle call; cancel the remote generator if we stop early."""
    try:
        async for item in gen:
            yield item
    except REPLICA_GONE as exc:
        raise EngineUnavailable(f"{type(exc).__name__}: the replica is gone") from None
    finally:
        gen.cancel()


class RayBackends(Backends):
    """The session's :class:`~pipeline.engines.Backends` through deployment handles (its in-process
    twin is ``pipeline.services.LocalBackends``). Every STT call of one stream carries its id as the
    routing key, so the STT deployment's consistent-hash router sends them all to the replica that
    holds the stream (UnknownStream comes back as itself); so does every call of one TTS utterance."""

    def __init__(self, stt: DeploymentHandle, llm: DeploymentHandle, tts: DeploymentHandle,
                 words: DeploymentHandle | None = None, word_voices: WordVoices = WordVoices()):
        """``words``: the TTS deployment of the family that takes words (DSM), routed by utterance id,
        which speaks ``word_voices`` (``tts`` itself where it is the only one); ``tts`` speaks the others."""
        self.stt, self.llm, self.tts = stt, llm, tts
        self.words, self.word_voices = words, word_voices

    def _stt(self, sid: str) -> DeploymentHandle:
        return self.stt.options(session_id=sid)

    @_engine_call
    async def stt_open(self, sid: str, language: str | None = None) -> None:
        handle = self._stt(sid)  # the language only when set: an STT replica of an older build takes (sid)
        reason = await (handle.open.remote(sid, language) if language is not None else handle.open.remote(sid))
        if reason:
            raise NoFreeSlot(reason)

    @_engine_call
    async def stt_push(self, sid: str, pcm: np.ndarray) -> list[dict]:
        return await self._stt(sid).push.remote(sid, pcm)

    @_engine_call
    async def stt_finish(self, sid: str) -> tuple[str, list[dict]]:
        return await self._stt(sid).finish.remote(sid)

    @_engine_call
    async def stt_peek(self, sid: str) -> tuple[str, list[dict]] | None:
        return await self._stt(sid).peek.remote(sid)

    @_engine_call
    async def stt_close(self, sid: str) -> None:
        await self._stt(sid).close.remote(sid)

    def llm_stream(self, messages: list[dict], sampling: Sampling) -> AsyncIterator[str | ToolCall | LLMFinish]:
        return _remote_stream(self.llm.options(stream=True).stream.remote(messages, sampling))

    def tts_stream(self, text: str, context: list[Segment], voice: Voice | None = None
                   ) -> AsyncIterator[tuple[np.ndarray, np.ndarray]]:
        speaker = self.words if self.words is not None and voice in self.word_voices else self.tts
        return _remote_stream(speaker.options(stream=True).stream.remote(text, context, voice))

    @_engine_call
    async def tts_encode(self, pcm: np.ndarray, rate: int = USER_RATE) -> np.ndarray:
        return await self.tts.encode.remote(pcm, rate)

    def _tts(self, uid: str) -> DeploymentHandle:
        return (self.words or self.tts).options(session_id=uid)

    @_engine_call
    async def tts_open(self, uid: str, voice: Voice | None = None) -> None:
        await self._tts(uid).open.remote(uid, voice)

    @_engine_call
    async def tts_feed(self, uid: str, pieces: list[tuple[str, bool]], final: bool = False) -> Fed:
        return await self._tts(uid).feed.remote(uid, pieces, final)

    @_engine_call
    async def tts_close(self, uid: str) -> None:
        await self._tts(uid).close.remote(uid)
