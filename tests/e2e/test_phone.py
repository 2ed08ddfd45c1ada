"""A phone call against `serve run`: a simulated Twilio carrier (load/phone.py, written from
Twilio's documentation) speaks espeak μ-law, plays the reply at real time and echoes its marks as
it plays; the caller speaks over the reply and the server clears what it queued; a key press gets a
reply of its own; the caller hangs up and the stream closes cleanly. Twilio and Telnyx alike. (What the history keeps of a cut reply: tests/test_phone.py.)"""
from __future__ import annotations

import asyncio
import re
import urllib.request

import numpy as np
import pytest

from load import speech
from load.phone import Phone, ulaw_frames
from tests.e2e.serve_process import PORT


def _replies(phone: Phone) -> set[str]:
    """The replies whose audio came, by their marks' names (reply id, then the chunk's number)."""
    return {name.rsplit(".", 1)[0] for name in phone.marks}


@pytest.mark.parametrize("provider", ["twilio", "telnyx"])
def test_a_call_is_answered_marks_come_back_in_order_the_caller_cuts_in_and_keys_are_heard(server, provider):
    question = ulaw_frames(speech.padded(speech.espeak("Tell me a long story about the old lighthouse."), 0.2, 0))
    quiet = ulaw_frames(np.zeros(32_000, np.int16))  # 2 s: the turn ends by itself
    cut_in = ulaw_frames(speech.espeak("Wait, stop there please."))

    before = {name: _metric(name, provider) for name in PHONE_COUNTS}

    async def go():
        async with Phone(f"ws://127.0.0.1:{PORT}/v1/phone/{provider}", provider) as phone:
            await phone.speak(question)
            await phone.speak(quiet)
            await phone.wait(lambda p: len(p.echoed) >= 3)  # the reply plays; its marks come back as it does
            cut_in_end = await phone.speak(cut_in)
            await phone.speak(quiet)  # a phone line carries silence on: the cut-in's turn ends by itself
            await phone.wait(lambda p: p.clears)
            await phone.reply_heard(cut_in_end)  # the cut-in's own reply, whole: then nothing plays
            replies = _replies(phone)
            await phone.press("5")  # a turn of its own: a new reply answers it
            await phone.wait(lambda p: _replies(p) - replies)
            await phone.hang_up()
            await phone.wait(lambda p: p.close_code is not None)
            return phone

    phone = asyncio.run(asyncio.wait_for(go(), 120))
    assert phone.close_code == 1000 and phone.clears
    sizes = {n for _, n in phone.received}
    assert sizes == {160}  # 20 ms μ-law frames
    assert phone.echoed == phone.marks[:len(phone.echoed)]  # echoed as played: in the order they were sent
    seqs = [int(name.rsplit(".", 1)[1]) for name in phone.marks if name.startswith(phone.marks[0].rsplit(".", 1)[0])]
    assert seqs == sorted(seqs) and len(seqs) >= 3  # one per reply chunk, in order
    # the gateway measured each echoed mark's playback delay, and the dead air between chunks
    after = {name: _metric(name, provider) for name in PHONE_COUNTS}
    measured = after["voice_phone_playback_delay_seconds_count"] - before["voice_phone_playback_delay_seconds_count"]
    assert 3 <= measured <= len(phone.echoed)  # a cut reply's marks echoed after its clear are not counted
    assert after["voice_phone_gap_seconds_count"] > before["voice_phone_gap_seconds_count"]
    assert after["voice_calls_total"] == before["voice_calls_total"] + 1


PHONE_COUNTS = ("voice_phone_playback_delay_seconds_count", "voice_phone_gap_seconds_count", "voice_calls_total")


def _metric(name: str, provider: str) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{PORT}/metrics", timeout=10) as r:
        text = r.read().decode()
    found = re.search(rf'^{name}{{provider="{provider}"}} (\S+)$', text, flags=re.M)
    return float(found.group(1)) if found else 0.0
