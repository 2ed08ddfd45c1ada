"""What a conversation needs from the engines: the :class:`Backends` contract, its failures and
the per-request settings a session may send with a call.

The contract is deliberately small: one STT stream per spoken turn, an LLM text stream, a TTS
audio stream (a clause each, or one utterance per reply fed word by word) and a Mimi encode. ``pipeline.services.LocalBackends`` (in-process services) and
``deployments.gateway.RayBackends`` (deployment handles) implement it; the model replicas import
this module for the failures they raise, never the conversation logic.

Per-request settings travel typed: every LLM call carries a :class:`Sampling` (its None fields
keep the replica's configured values, so ``Sampling()`` is the server's defaults); a TTS call
carries a ``voice`` only when a session chose one other than the default.
"""
from __future__ import annotations

import asyncio
from abc import abstractmethod
from dataclasses import dataclass
from typing import Any, AsyncIterator, Awaitable, Protocol, TypeVar

import numpy as np

from pipeline.audio_constants import USER_RATE

# Speaker ids of a session's context: the bot's turns (the TTS gives them the voice's speaker id) and
# the user's turns.
BOT_SPEAKER = 0
USER_SPEAKER = 1


@dataclass(eq=False)
class Segment:
    """One conversation turn of the TTS's context: ``codes`` are its Mimi frames [T, 32] (user audio
    encoded once, bot turns reuse the codes they were generated from: never re-encode generated
    audio). Segments compare by identity: the same turn, not equal codes. Part of the engine
    contract: the conversation builds them, the TTS (pipeline/tts/prompt.py) reads them."""

    speaker: int
    text: str
    codes: np.ndarray

T = TypeVar("T")


class NoFreeSlot(Exception):
    """The recogniser has no free slot for a new spoken turn."""


class EngineUnavailable(Exception):
    """An engine did not answer within ``engine_timeout_s``, or the replica serving it is gone."""


class EngineBusy(Exception):
    """An engine has no room for another stream now (every TTS slot taken and its waiting line
    full): the client hears ``server_busy``, the session carries on."""


class ClientGone(Exception):
    """The client left while the server was sending to it: the end of the session, not a fault."""


class UnknownStream(Exception):
    """The STT replica that got a call holds no stream of that id (it was never opened there, or
    the replica that held it was replaced): never a silent loss, the session restarts the turn."""


@dataclass(frozen=True)
class Sampling:
    """How one LLM reply is sampled, as a session chose it; None keeps the LLM replica's configured
    value. ``tools`` are OpenAI function tools ({"type": "function", "name", "description",
    "parameters"}); ``tool_choice`` is "auto", "required" or {"type": "function", "name": ...}.
    Crosses the Ray boundary to the LLM replica as it is (picklable)."""

    temperature: float | None = None
    max_output_tokens: int | None = None  # new tokens of one reply at most
    tools: tuple[dict, ...] | None = None
    tool_choice: str | dict | None = None


@dataclass(frozen=True)
class ToolCall:
    """A call the LLM made: the client runs the tool and answers with its output for ``call_id``."""

    call_id: str
    name: str
    arguments: str  # JSON text


@dataclass(frozen=True)
class LLMFinish:
    """The last item of an LLM stream: why it stopped (``"stop"``, or ``"length"`` when the reply
    reached its token limit) and, where the backend knows them, its token counts."""

    reason: str
    prompt_tokens: int | None = None
    completion_tokens: int | None = None


@dataclass(frozen=True)
class Voice:
    """Who speaks a reply: a voice configured on the TTS replica (``name``: its CSM speaker id and
    reference clip, encoded once at start-up), optionally with the session's own reference clip
    (``reference``: its codes and transcript), which then replaces the named voice's clip."""

    name: str = "default"
    reference: Segment | None = None


@dataclass(frozen=True)
class Fed:
    """What one feed of an utterance answers: the chunks made since the last, each (mark: the index
    of the last clause whose audio begins in it, else None; int16 24 kHz pcm; codes [n, 32]);
    ``ended``: its last chunk is among them; ``hungry``: it waits for more words (feed again when
    the LLM has written some, not before)."""

    chunks: list
    ended: bool
    hungry: bool


@dataclass(frozen=True)
class WordVoices:
    """The voices whose TTS family takes words (DSM): ``every`` voice where that family is the only
    one served, else those ``names`` (a server serving both families speaks each voice with its own).
    ``None`` as a voice is the server's default voice, named "default"."""

    names: frozenset[str] = frozenset()
    every: bool = False

    def __contains__(self, voice: "Voice | str | None") -> bool:
        name = voice.name if isinstance(voice, Voice) else (voice or "default")
        return self.every or name in self.names


class Backends(Protocol):
    """What a session needs from the engines. Audio crosses as contiguous numpy arrays.

    One STT stream per spoken turn: ``stt_open`` takes a slot, ``stt_finish`` returns the turn's
    transcript and gives the slot back, ``stt_close`` gives it back without one (idempotent).

    The two implementations subclass this explicitly (``pipeline.services.LocalBackends``: the
    services in this process; ``deployments.gateway.RayBackends``: deployment handles), so a type
    checker verifies their signatures and a missing method fails at construction (abstract);
    tests/test_backends.py compares both with it. Test doubles may stay duck-typed: a session
    calls ``llm_stream(messages, sampling=...)``, and with default settings ``tts_stream(text,
    context)`` and ``tts_encode(pcm)`` exactly so; one without ``word_voices`` is a TTS that takes a
    clause per stream (:func:`takes_words`)."""

    # Any call may raise EngineUnavailable; stt_push and stt_finish raise UnknownStream.
    @abstractmethod
    async def stt_open(self, sid: str, language: str | None = None) -> None: ...  # raises NoFreeSlot; reopening an open sid restarts it; language: None = the recogniser's default
    @abstractmethod
    async def stt_push(self, sid: str, pcm: np.ndarray) -> list[dict]: ...  # [{"kind","text"}]
    @abstractmethod
    async def stt_finish(self, sid: str) -> tuple[str, list[dict]]: ...  # (text, words with times); frees the slot
    # What stt_finish would give now, the stream going on (None: no spare slot); raises UnknownStream
    @abstractmethod
    async def stt_peek(self, sid: str) -> tuple[str, list[dict]] | None: ...
    @abstractmethod
    async def stt_close(self, sid: str) -> None: ...
    # Text deltas (str) and ToolCalls, then possibly one LLMFinish
    @abstractmethod
    def llm_stream(self, messages: list[dict], sampling: Sampling) -> AsyncIterator[str | ToolCall | LLMFinish]: ...
    # (int16 24 kHz chunk, Mimi codes [n, 32] of the frames that made it)
    @abstractmethod
    def tts_stream(self, text: str, context: list[Segment], voice: Voice | None = None
                   ) -> AsyncIterator[tuple[np.ndarray, np.ndarray]]: ...
    # int16 audio at ``rate`` (a user turn: 16 kHz; a reference clip: 24 kHz) -> Mimi codes [T, 32]
    @abstractmethod
    async def tts_encode(self, pcm: np.ndarray, rate: int = USER_RATE) -> np.ndarray: ...

    # A TTS that takes words (DSM) speaks a reply as one utterance: opened, then fed its whole words as
    # the LLM writes them, in pieces (words, whether they begin a clause), one feed in flight at a time,
    # each answering with the chunks made since the last (:class:`Fed`); closed if cut short. It takes no conversation
    # context. ``word_voices``: the voices so spoken (a server may serve both families, a family per voice);
    # for the others these raise NotImplementedError.
    word_voices: WordVoices = WordVoices()
    @abstractmethod
    async def tts_open(self, uid: str, voice: Voice | None = None) -> None: ...  # raises EngineBusy
    @abstractmethod
    async def tts_feed(self, uid: str, pieces: list[tuple[str, bool]], final: bool = False) -> Fed: ...  # raises UnknownStream
    @abstractmethod
    async def tts_close(self, uid: str) -> None: ...  # idempotent


def takes_words(backends, voice: "Voice | str | None" = None) -> bool:
    """Whether ``backends`` speak ``voice`` (None: the default voice) as one utterance per reply, fed
    word by word (DSM); a test double without ``word_voices`` takes a clause per stream."""
    return voice in getattr(backends, "word_voices", WordVoices())


async def bounded(call: Awaitable[T], timeout_s: float) -> T:
    """One engine call that must answer within ``timeout_s`` (else :class:`EngineUnavailable`).
    ``asyncio.timeout``, not ``wait_for``: Python 3.11's ``wait_for`` swallows a cancellation that
    arrives as the call completes, and a cancelled reply then played on (tests/test_conversation.py)."""
    try:
        async with asyncio.timeout(timeout_s):
            return await call
    except TimeoutError:
        raise EngineUnavailable(f"no answer within {timeout_s:g} s") from None


async def bounded_stream(stream: AsyncIterator[T], timeout_s: float) -> AsyncIterator[T]:
    """An engine stream whose every next item must come within ``timeout_s``; closed when left."""
    try:
        while True:
            try:
                async with asyncio.timeout(timeout_s):
                    item = await anext(stream)
            except StopAsyncIteration:
                return
            except TimeoutError:
                raise EngineUnavailable(f"no next item within {timeout_s:g} s") from None
            yield item
    finally:
        await stream.aclose()


def match_language(language: str, known) -> str | None:
    """The code among ``known`` that ``language`` names: itself, or its primary subtag ("fr-CA" ->
    "fr" where only "fr" is known), case-insensitively (BCP 47); None when neither is known, or
    when ``language`` is no code at all (not a non-empty string)."""
    if not isinstance(language, str) or not language:
        return None
    lowered = {c.lower(): c for c in known}
    for code in (language, language.split("-")[0]):
        if code.lower() in lowered:
            return lowered[code.lower()]
    return None
