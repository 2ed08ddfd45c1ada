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
    """A reply's clauses fed into one TTS utterance as they come, its chunks into ``chunks`` as
    :func:`synthesize` puts them (the clauses a chunk begins, joined, on it). One feed in flight
    at a time (each answers with the chunks made since the last); while the utterance waits for
    words the next clause is awaited, not polled. A feed must answer within ``engine_timeout_s``,
    and the utterance make audio within it of its last words or chunk."""
    host = reply.host
    backends, timeout_s = host.backends, host.cfg.engine_timeout_s
    waits = reply.air.stages
    uid = uuid.uuid4().hex
    said: list[str] = []  # the clauses fed so far (not empty)
    told = 0  # of them, those whose text went out with a chunk
    ended = False
    try:
        waits.wait("synthesis", LLM)
        if (clause := await clauses.get()) is None:
            ended = True
            return
        waits.wait("synthesis", TTS)
        if reply.ahead is not None and reply.ahead.first is not None:
            await reply.ahead.first.cancel()  # (none is started where the TTS takes words)
        reply.mark("tts_request_ms", started)
        await bounded(backends.tts_open(uid, host.reply_voice(reply)), timeout_s)
        new, final, hungry = [clause], False, False
        progress = asyncio.get_running_loop().time()
        while True:
            if hungry and not new and not final:
                waits.wait("synthesis", LLM)  # the TTS has said all it was given
                new.append(await clauses.get())
                waits.wait("synthesis", TTS)
                progress = asyncio.get_running_loop().time()
            while not clauses.empty():
                new.append(clauses.get_nowait())
            if new and new[-1] is None:
                new.pop()
                final = True
            fed = await bounded(backends.tts_feed(uid, new, final), timeout_s)
            said += [c for c in new if c.strip()]
            new = []
            for mark, pcm, codes in fed.chunks:
                reply.mark("tts_first_chunk_ms", started)
                text = None
                if mark is not None and mark >= told:
                    text, told = " ".join(said[told:mark + 1]), mark + 1
                chunks.put_nowait((text, pcm, codes))
            ended, hungry = fed.ended, fed.hungry
            if ended:
                return
            now = asyncio.get_running_loop().time()
            if fed.chunks or hungry:
                progress = now
            elif now - progress > timeout_s:
                raise EngineUnavailable(f"the TTS made no audio within {timeout_s:g} s")
            if final:
                final = False  # said once; the next feeds only take what was made
                new, hungry = [], False
    finally:
        waits.done("synthesis")
        chunks.put_nowait(None)
        if not ended:  # cut short: free its row now (shielded: this task may be cancelled)
            with contextlib.suppress(Exception):
                await asyncio.shield(backends.tts_close(uid))
