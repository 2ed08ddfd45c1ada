"""CSM prompts: conversation segments as rows of 32 audio columns + 1 text column.

A text segment is ``<|begin_of_text|>[{speaker}]{text}<|end_of_text|>``, one row per token (text
column only). An audio segment is one row per Mimi frame (audio columns only) followed by an
all-zero frame, CSM's end-of-audio marker. Context segments are ``text + audio``; the utterance to
speak is text only, and generation continues from its last row.
"""
from __future__ import annotations

import numpy as np

from pipeline.engines import BOT_SPEAKER, USER_SPEAKER, Segment  # noqa: F401 - the contract's, used here

NUM_CODEBOOKS = 32


class PromptBuilder:
    def __init__(self, tokenizer, num_codebooks: int = NUM_CODEBOOKS):
        self.tokenizer = tokenizer
        self.k = num_codebooks
        self.bos = tokenizer.convert_tokens_to_ids("<|begin_of_text|>")
        self.eos = tokenizer.convert_tokens_to_ids("<|end_of_text|>")

    def text_rows(self, speaker: int, text: str) -> tuple[np.ndarray, np.ndarray]:
        ids = [self.bos, *self.tokenizer.encode(f"[{speaker}]{text}", add_special_tokens=False), self.eos]
        tokens = np.zeros((len(ids), self.k + 1), dtype=np.int64)
        mask = np.zeros_like(tokens, dtype=bool)
        tokens[:, self.k] = ids
        mask[:, self.k] = True
        return tokens, mask

    def audio_rows(self, codes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        codes = np.asarray(codes, dtype=np.int64).reshape(-1, self.k)
        tokens = np.zeros((len(codes) + 1, self.k + 1), dtype=np.int64)  # + the all-zero end frame
        tokens[: len(codes), : self.k] = codes
        mask = np.zeros_like(tokens, dtype=bool)
        mask[:, : self.k] = True
        return tokens, mask

    def segment_rows(self, seg: Segment) -> tuple[np.ndarray, np.ndarray]:
        (t1, m1), (t2, m2) = self.text_rows(seg.speaker, seg.text), self.audio_rows(seg.codes)
        return np.concatenate([t1, t2]), np.concatenate([m1, m2])

    def build(self, speaker: int, text: str, context: list[Segment] | None, max_rows: int,
              reference: Segment | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Rows of ``reference`` (the voice's clip), ``context``, then the text to speak, at most
        ``max_rows``.

        The reference stays first while it fits beside the text; the oldest context segments are
        dropped whole to fit; a text alone too long is cut.
        """
        tokens, mask = self.text_rows(speaker, text)
        if len(tokens) > max_rows:
            keep = max(2, max_rows)
            tokens = np.concatenate([tokens[: keep - 1], tokens[-1:]])
            mask = np.concatenate([mask[: keep - 1], mask[-1:]])
            return tokens, mask
        parts = [(tokens, mask)]
        used = len(tokens)
        pinned = self.segment_rows(reference) if reference is not None else None
        if pinned is not None and used + len(pinned[0]) > max_rows:
            pinned = None
        if pinned is not None:
            used += len(pinned[0])
        for seg in reversed(context or []):
            rows = self.segment_rows(seg)
            if used + len(rows[0]) > max_rows:
                break
            parts.append(rows)
            used += len(rows[0])
        if pinned is not None:
            parts.append(pinned)
        parts.reverse()
        return np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])
