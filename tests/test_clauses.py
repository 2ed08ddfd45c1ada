"""Clause splitting for the LLM -> TTS handoff."""
import pytest

from pipeline.conversation.clauses import ClauseSplitter


def split_stream(text, pieces=None, **kw):
    s = ClauseSplitter(**kw)
    out = []
    for piece in pieces or [w + " " for w in text.split(" ")]:
        out += s.push(piece)
    return out + s.flush()


@pytest.mark.parametrize(
    "text,expected",
    [
        ("Hello there! How are you?", ["Hello there!", "How are you?"]),
        ("I met Dr. Smith at 5 p.m. today.", ["I met Dr. Smith at 5 p.m. today."]),
        ("It costs 3.5 dollars, or about 1,000 yen in total.", ["It costs 3.5 dollars,", "or about 1,000 yen in total."]),
        ("Yes, sure.", ["Yes, sure."]),  # a comma splits only after a few words
        ("Wait... what?!", ["Wait...", "what?!"]),
        ("no punctuation at all here", ["no punctuation at all here"]),
    ],
)
def test_clauses(text, expected):
    assert split_stream(text) == expected


def test_long_clause_is_cut_at_word_boundary():
    words = [f"w{i}" for i in range(30)]
    out = split_stream(" ".join(words), max_words=12)
    assert [len(c.split()) for c in out] == [12, 12, 6]
    assert " ".join(out) == " ".join(words)


def test_sentence_end_is_not_held_for_the_next_token():
    s = ClauseSplitter()
    assert s.push("Hello") == []
    assert s.push(" world.") == ["Hello world."]  # emitted before any further token


def test_digit_dot_waits_for_next_token():
    s = ClauseSplitter()
    assert s.push("Pi is 3.") == []
    assert s.push("14 roughly. ") == ["Pi is 3.14 roughly."]
