"""The session's engines in this process: the Backends contract over the three services."""
from __future__ import annotations

from typing import AsyncIterator

import numpy as np

from pipeline.audio_constants import USER_RATE
from pipeline.engines import Backends, Fed, LLMFinish, NoFreeSlot, Sampling, Segment, ToolCall, Voice, WordVoices
from pipeline.runtime.threads import InferenceThread
from pipeline.services.llm import LLMService, load_llm
from pipeline.services.stt import STTService, load_stt
from pipeline.services.tts import TTSService, load_tts


class LocalBackends(Backends):
    """The session's :class:`~pipeline.engines.Backends` over in-process services (no Ray); its
    twin over Ray deployment handles is ``deployments.gateway.RayBackends``."""

    def __init__(self, stt: STTService, llm: LLMService, tts: TTSService, words: TTSService | None = None,
                 word_voices: WordVoices = WordVoices()):
        """``tts`` speaks every voice, or with ``words`` (a second family, that takes words) beside it all
        but ``word_voices``. A ``tts`` that takes words alone speaks every voice so."""
        self.stt, self.llm, self.tts = stt, llm, tts
        if words is None and tts.takes_words:
            words, word_voices = tts, WordVoices(every=True)
        self.words, self.word_voices = words, word_voices

    def _speaker(self, voice: Voice | None) -> TTSService:
        return self.words if self.words is not None and voice in self.word_voices else self.tts

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
        return self._speaker(voice).stream(text, context, voice)

    async def tts_encode(self, pcm: np.ndarray, rate: int = USER_RATE) -> np.ndarray:
        return await self.tts.encode(pcm, rate)

    def _words(self) -> TTSService:
        return self.words if self.words is not None else self.tts  # (which raises NotImplementedError)

    async def tts_open(self, uid: str, voice: Voice | None = None) -> None:
        await self._words().open(uid, voice)

    async def tts_feed(self, uid: str, pieces: list[tuple[str, bool]], final: bool = False) -> Fed:
        return await self._words().feed(uid, pieces, final)

    async def tts_close(self, uid: str) -> None:
        await self._words().close(uid)
