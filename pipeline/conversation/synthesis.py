"""A reply's speech made: its clauses through the TTS, one after another, as the LLM writes them.

The synthesis runs beside the reply's sender (``pipeline/conversation/reply.py``): the next clause
is made as soon as the previous one is, not when it has been played. What it waits on (the LLM's
next clause, or the TTS) is kept on the reply's dead-air clock.

A voice whose TTS takes words (DSM, ``Backends.word_voices``) speaks the whole reply as one utterance
instead (:func:`synthesize_words`): its words are fed as the LLM writes them, so it starts on the
first words, not the first clause, and its audio comes back as one stream whose chunks mark where
each clause begins. A stream per clause would pay the model's lead of text on audio (about two
seconds of frames) at every clause.
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
    voice = host.reply_voice(reply)
    if takes_words(host.backends, voice):
        return await synthesize_words(reply, clauses, chunks, started, voice)
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
            now = host.reply_voice(reply)  # a new voice takes the next clause, unless it takes words (DSM
            voice = voice if takes_words(host.backends, now) else now  # speaks a reply whole: from the next)
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


class Words:
    """A reply's words as the LLM writes them, for a TTS that takes words: the clauses the splitter
    cut (from the queue) and the whole words of the one being written (``Reply.writing``), with
    where each clause begins (a word index)."""

    def __init__(self, reply, clauses: asyncio.Queue):
        self.reply, self.clauses = reply, clauses
        self.cut: list[str] = []  # the clauses cut so far
        self.words: list[str] = []  # their words
        self.starts = [0]  # the word each clause begins at (the last: the one being written)
        self.done = False  # the LLM has written its last word
        self.fed = 0  # words fed so far

    def take(self) -> None:
        """What the LLM wrote since the last look (the queue and ``writing`` change together)."""
        while not self.clauses.empty():
            clause = self.clauses.get_nowait()
            if clause is None:
                self.done = True
                continue
            self.cut.append(clause)
            self.words += clause.split()
            self.starts.append(len(self.words))

    def pieces(self) -> list[tuple[str, bool]]:
        """The whole words not fed yet, in pieces cut where a clause begins: (words, begins a clause)."""
        writing = self.reply.writing
        more = writing.split()
        if more and not writing[-1].isspace():
            more = more[:-1]  # its last word may go on
        known = self.words + more
        out = []
        while self.fed < len(known):
            end = next((b for b in self.starts if b > self.fed), len(known))
            end = min(end, len(known))
            out.append((" ".join(known[self.fed:end]), self.fed in self.starts))
            self.fed = end
        return out


async def synthesize_words(reply, clauses: asyncio.Queue, chunks: asyncio.Queue, started: float,
                           voice: Voice | None = None) -> None:
    """A reply fed into one TTS utterance in ``voice`` word by word as the LLM writes it (whole words, cut where a
    clause begins), its chunks into ``chunks`` as :func:`synthesize` puts them (the clauses begun
    by a chunk, once the splitter has cut them, on it). One feed in flight at a time (each answers
    with the chunks made since the last); while the utterance waits for words the LLM is awaited,
    not polled. A feed must answer within ``engine_timeout_s``, and the utterance make audio within
    it of its last words or chunk."""
    host = reply.host
    backends, timeout_s = host.backends, host.cfg.engine_timeout_s
    waits = reply.air.stages
    uid = uuid.uuid4().hex
    words = Words(reply, clauses)
    begun = told = 0  # clauses whose audio has begun; of them, those whose text went out with a chunk
    ended = opened = False
    loop = asyncio.get_running_loop()
    try:
        new = await _written(reply, words, waits)
        if not new:
            ended = True  # nothing to say
            return
        if reply.ahead is not None and reply.ahead.first is not None:
            await reply.ahead.first.cancel()  # (none is started where the TTS takes words)
        reply.mark("tts_request_ms", started)
        await bounded(backends.tts_open(uid, voice), timeout_s)
        opened, all_said, hungry, progress = True, False, False, loop.time()
        while True:
            if hungry and not new and not all_said:
                new = await _written(reply, words, waits)
                progress = loop.time()
            final = words.done and not all_said
            fed = await bounded(backends.tts_feed(uid, new, final), timeout_s)
            all_said = all_said or final
            for mark, pcm, codes in fed.chunks:
                reply.mark("tts_first_chunk_ms", started)
                begun = max(begun, mark + 1) if mark is not None else begun
                upto = min(begun, len(words.cut))  # a clause still being written joins a later chunk
                text = " ".join(words.cut[told:upto]) if upto > told else None
                told = max(told, upto)
                chunks.put_nowait((text, pcm, codes))
            ended, hungry = fed.ended, fed.hungry
            if ended:
                return
            now = loop.time()
            if fed.chunks or hungry:
                progress = now
            elif now - progress > timeout_s:
                raise EngineUnavailable(f"the TTS made no audio within {timeout_s:g} s")
            words.take()
            new = [] if all_said else words.pieces()  # all said: the next feeds only take what was made
    finally:
        waits.done("synthesis")
        chunks.put_nowait(None)
        if opened and not ended:  # cut short: free its row now (shielded: this task may be cancelled)
            with contextlib.suppress(Exception):
                await asyncio.shield(backends.tts_close(uid))


async def _written(reply, words: Words, waits) -> list[tuple[str, bool]]:
    """The LLM's next whole words (none once it has written its last), waited for."""
    waits.wait("synthesis", LLM)
    while True:
        reply.wrote.clear()
        words.take()
        new = words.pieces()
        if new or words.done:
            waits.wait("synthesis", TTS)
            return new
        await reply.wrote.wait()
