"""The client examples of docs/clients.md: its blocks are the files under examples/ (scripts/readme_examples.py),
and each example, with no server there, fails within seconds and says so. (Against `serve run`:
tests/e2e/test_examples.py.)"""
from __future__ import annotations

import time

import pytest

from scripts import readme_examples
from tests.e2e.test_examples import EXAMPLES, run_example
from tests.example_envs import env_python


def test_the_clients_doc_shows_each_example_file_as_it_is(tmp_path):
    doc = readme_examples.DOC
    shown = [name for name, _ in readme_examples.blocks((readme_examples.ROOT / doc).read_text())]
    assert sorted(shown) == sorted(f"examples/{file}" for file, _ in EXAMPLES.values())
    assert readme_examples.differing() == []
    # the check can fail: a doc whose block lost a line
    (tmp_path / "examples").mkdir()
    for name in shown:
        (tmp_path / name).write_text((readme_examples.ROOT / name).read_text())
    name = shown[0]
    text = (readme_examples.ROOT / doc).read_text()
    block = readme_examples.blocks(text)[0][1]
    (tmp_path / "docs").mkdir()
    (tmp_path / doc).write_text(text.replace(block, block.split("\n", 1)[1], 1))
    assert name in readme_examples.differing(tmp_path)


@pytest.mark.parametrize("name", EXAMPLES)
def test_an_example_with_no_server_fails_within_seconds_and_says_so(name):
    env_python(name)  # made (or found) first: only the example's own run is timed
    started = time.monotonic()
    done = run_example(name, "http://127.0.0.1:9")  # nothing listens on port 9
    took = time.monotonic() - started
    assert done.returncode != 0 and "gapless at " in done.stderr, (done.stdout, done.stderr[-2000:])
    assert took < 30, took
