"""A reply's speech made: its clauses through the TTS, one after another, as the LLM writes them.

The synthesis runs beside the reply's sender (``pipeline/conversation/reply.py``): the next clause
is made as soon as the previous one is, not when it has been played. What it waits on (the LLM's
next clause, or the TTS) is kept on the reply's dead-air clock.
"""
from __future__ import annotations

import asyncio
import contextlib
import numpy as np

from pipeline.conversation.dead_air import LLM, TTS
from pipeline.engines import BOT_SPEAKER, Segment, Voice, bounded_stream


async def synthesize(reply, clauses: asyncio.Queue, chunks: asyncio.Queue, started: float) -> None:
    """A reply's (pipeline/conversation/reply.py) clauses through the TTS, in order, into ``chunks`` as (clause on its first chunk
    else None, pcm, codes); None at the end, also when it fails. A clause continues the voice
    of the reply's clauses made before it (their generated codes are its context) unless the
    voice changed in between."""
    host = reply.host
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
