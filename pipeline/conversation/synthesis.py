"""A reply's speech made: its clauses through the TTS, one after another, as the LLM writes them.

The synthesis runs beside the reply's sender (``pipeline/conversation/reply.py``): the next clause
is made as soon as the previous one is, not when it has been played. What it waits on (the LLM's
next clause, or the TTS) is kept on the reply's dead-air clock.

A TTS that takes words (DSM, ``Backends.tts_words``) speaks the whole reply as one utterance
instead (:func:`synthesize_words`): each clause is said into it as the LLM writes it, and its
audio comes back as one stream whose chunks mark where each clause begins. A stream per clause
would pay the model's lead of text on audio (about two seconds of frames) at every clause.
"""
from __future__ import annotations

import asyncio
import contextlib
import uuid

import numpy as np

from pipeline.conversation.dead_air import LLM, TTS
from pipeline.engines import BOT_SPEAKER, EngineUnavailable, Segment, Voice, bounded, bounded_stream, takes_words


async def synthesize(reply, clauses: asyncio.Queue, chunks: asyncio.Queue, started: float) -> None:
    """A reply's (pipeline/conversation/reply.py) clauses through the TTS, in order, into ``chunks`` as (clause on its first chunk
    else None, pcm, codes); None at the end, also when it fails. A clause continues the voice
    of the reply's clauses made before it (their generated codes are its context) unless the
    voice changed in between."""
    host = reply.host
    if takes_words(host.backends):
        return await synthesize_words(reply, clauses, chunks, started)
    made_text: list[str] = []
    made_codes: list[np.ndarray] = []
    made_voice: Voice | None = None
    waits = reply.air.stages
    opening = True  # the reply's first clause is next (it may have been made ahead)
    try:
        while True:
            waits.wait("synthesis", LLM)  # the LLM's next clause
            if (clause := await clauses.get()) is None:
                break
            waits.wait("synthesis", TTS)
            if reply.encoding is not None:
                await reply.encoding  # the user's turn joins the context before the first clause
                reply.encoding = None
            reply.mark("tts_request_ms", started)  # the first clause goes to the TTS (its context ready)
            voice = host.reply_voice(reply)
            if voice != made_voice:
                made_text, made_codes, made_voice = [], [], voice
            context = host.tts_context()
            if made_codes:
                context.append(Segment(BOT_SPEAKER, " ".join(made_text), np.concatenate(made_codes)))
            ahead = reply.ahead.first if opening and reply.ahead is not None else None
            opening = False
            if ahead is not None and ahead.fits(clause, voice):
                tts = ahead.chunks()  # made on this same context (pipeline/conversation/speculation.py)
            else:
                if ahead is not None:
                    await ahead.cancel()
                tts = host.backends.tts_stream(clause, context) if voice is None else \
                    host.backends.tts_stream(clause, context, voice)
            first = True
            async with contextlib.aclosing(bounded_stream(tts, host.cfg.engine_timeout_s)) as made:
                async for pcm, codes in made:  # (closed at once when cancelled, as the LLM stream above)
                    reply.mark("tts_first_chunk_ms", started)
                    chunks.put_nowait((clause if first else None, pcm, codes))
                    made_codes.append(codes)
                    first = False
            if not first:
                made_text.append(clause)
    finally:
        waits.done("synthesis")
        chunks.put_nowait(None)


async def synthesize_words(reply, clauses: asyncio.Queue, chunks: asyncio.Queue, started: float) -> None:
    """A reply's clauses said into one TTS utterance as they come, its chunks into ``chunks`` as
    :func:`synthesize` puts them (the clauses a chunk begins, joined, on it). The utterance's next
    chunk must come within ``engine_timeout_s`` of the last chunk or clause, except while the
    LLM's next clause is awaited (the TTS then owes nothing it has been told)."""
    host = reply.host
    timeout_s = host.cfg.engine_timeout_s
    waits = reply.air.stages
    uid = uuid.uuid4().hex
    said: list[str] = []  # the clauses said so far (not empty)
    loop = asyncio.get_running_loop()
    awaiting_llm = False

    async def feed(clause: str | None, deadline: asyncio.Timeout) -> None:
        nonlocal awaiting_llm
        while True:
            if clause is not None and clause.strip():
                said.append(clause)
            await bounded(host.backends.tts_say(uid, clause or "", clause is None), timeout_s)
            if clause is None:
                return
            waits.wait("synthesis", LLM)
            awaiting_llm = True
            deadline.reschedule(None)
            clause = await clauses.get()
            awaiting_llm = False
            waits.wait("synthesis", TTS)
            deadline.reschedule(loop.time() + timeout_s)

    async def hear(deadline: asyncio.Timeout) -> None:
        told = 0  # clauses whose text went out with a chunk
        async with contextlib.aclosing(host.backends.tts_chunks(uid)) as made:
            async for mark, pcm, codes in made:
                reply.mark("tts_first_chunk_ms", started)
                text = None
                if mark is not None and mark >= told:
                    text, told = " ".join(said[told:mark + 1]), mark + 1
                chunks.put_nowait((text, pcm, codes))
                if not awaiting_llm:
                    deadline.reschedule(loop.time() + timeout_s)

    try:
        waits.wait("synthesis", LLM)
        if (first := await clauses.get()) is None:
            return
        waits.wait("synthesis", TTS)
        if reply.ahead is not None and reply.ahead.first is not None:
            await reply.ahead.first.cancel()  # (none is started where the TTS takes words)
        reply.mark("tts_request_ms", started)
        await bounded(host.backends.tts_open(uid, host.reply_voice(reply)), timeout_s)
        try:
            async with asyncio.timeout(loop.time() + timeout_s) as deadline, asyncio.TaskGroup() as both:
                both.create_task(feed(first, deadline))
                both.create_task(hear(deadline))
        except BaseExceptionGroup as group:  # the first failure, as a lone task would raise it
            raise group.exceptions[0] from None
    except TimeoutError:
        raise EngineUnavailable(f"the TTS made no audio within {timeout_s:g} s") from None
    finally:
        waits.done("synthesis")
        chunks.put_nowait(None)
