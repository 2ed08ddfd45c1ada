"""Clause-level handoff from a token stream to TTS.

The TTS starts on the first clause, not on the whole reply. A clause ends at sentence
punctuation, at a comma/semicolon/colon once the clause has a few words, or when it
reaches ``max_words`` (cut at a word boundary), whichever comes first. Punctuation at the
very end of the buffer counts at once (we do not wait for the next token to confirm it),
except where it is ambiguous: a known abbreviation ("Dr.") or a digit followed by "." or ","
(which may continue as "3.5" or "1,000").
"""
from __future__ import annotations

import re

ABBREVIATIONS = frozenset(
    "mr mrs ms dr prof sr jr st vs etc e.g i.e a.m p.m u.s no fig approx dept est inc ltd co".split()
)
_SENTENCE_END = ".!?"
_SOFT_END = ",;:"


class ClauseSplitter:
    def __init__(self, max_words: int = 12, min_words_soft: int = 4):
        self.max_words = max_words
        self.min_words_soft = min_words_soft
        self._buf = ""

    def push(self, delta: str) -> list[str]:
        """Add a text delta; return the clauses it completed (possibly none)."""
        self._buf += delta
        out = []
        while True:
            cut = self._find_cut()
            if cut is None:
                break
            clause, self._buf = self._buf[:cut].strip(), self._buf[cut:].lstrip()
            if clause:
                out.append(clause)
        return out

    @property
    def pending(self) -> str:
        """The clause being written: its text so far, not yet cut."""
        return self._buf

    def flush(self) -> list[str]:
        """The rest of the reply, once the token stream ended."""
        rest, self._buf = self._buf.strip(), ""
        return [rest] if rest else []

    # ------------------------------------------------------------------ internals
    def _find_cut(self) -> int | None:
        buf = self._buf
        words_before = 0
        in_word = False
        for i, ch in enumerate(buf):
            if ch.isspace():
                if in_word:
                    words_before += 1
                    if words_before >= self.max_words:
                        return i
                in_word = False
                continue
            in_word = True
            if ch in _SENTENCE_END or ch in _SOFT_END:
                nxt = buf[i + 1] if i + 1 < len(buf) else None
                if nxt is not None and not nxt.isspace() and nxt not in _SENTENCE_END + "\"')":
                    continue  # inside a token such as "3.5", "e.g.", "1,000"
                if nxt is None and i > 0 and buf[i - 1].isdigit() and ch in ".,":
                    continue  # "3." may become "3.5": wait for one more token
                if ch == "." and self._is_abbreviation(buf[: i + 1]):
                    continue
                if ch in _SOFT_END and words_before + 1 < self.min_words_soft:
                    continue
                # take closing quotes/brackets and repeated punctuation ("?!", "...") along
                j = i + 1
                while j < len(buf) and buf[j] in _SENTENCE_END + "\"')":
                    j += 1
                return j
        return None

    @staticmethod
    def _is_abbreviation(text: str) -> bool:
        m = re.search(r"([A-Za-z][A-Za-z.]*)\.$", text)
        if not m:
            return False
        word = m.group(1).lower()
        return word in ABBREVIATIONS or (len(word) == 1 and word.isalpha())
