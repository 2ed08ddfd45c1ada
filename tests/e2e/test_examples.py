"""The four client examples (examples/, shown in docs/clients.md: scripts/readme_examples.py)
run against `serve run`, each in its own environment with its client at the pinned version
(tests/example_envs.py), as a new user would run them: each must hear reply audio, and the
Agents SDK's must hear the answer after its tool. (With no server: tests/test_examples.py.)"""
from __future__ import annotations

import os
import re
import subprocess

import pytest

from tests.e2e.serve_process import PORT, ROOT
from tests.example_envs import env_python

# example -> (file, what it prints: numbers that must all be > 0)
EXAMPLES = {"openai": ("openai_realtime.py", r"([\d.]+) s of audio"),
            "agents": ("agents_realtime.py", r"([\d.]+) s of audio, ([\d.]+) s of it after the tool"),
            "livekit": ("livekit_realtime.py", r"(\d+) audio frames"),
            "pipecat": ("pipecat_realtime.py", r"(\d+) audio frames")}


def run_example(name: str, url: str, timeout: float = 150) -> subprocess.CompletedProcess:
    """The example in its own environment, with nothing of this one's (no PYTHONPATH, no venv)."""
    env = {"PATH": "/usr/bin:/bin", "HOME": os.environ.get("HOME", "/root"), "GAPLESS_URL": url,
           "TOOL_CHOICE": "required"}  # the tiny profile's random weights never pick a tool themselves
    return subprocess.run([str(env_python(name)), str(ROOT / "examples" / EXAMPLES[name][0])], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("name", EXAMPLES)
def test_the_readme_example_hears_a_reply(server, name):
    done = run_example(name, f"http://127.0.0.1:{PORT}")
    assert done.returncode == 0, done.stderr[-3000:]
    found = re.search(EXAMPLES[name][1], done.stdout)
    assert found and all(float(n) > 0 for n in found.groups()), done.stdout
