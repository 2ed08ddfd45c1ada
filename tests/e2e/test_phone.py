"""A phone call against `serve run`: a simulated Twilio carrier (load/phone.py, written from
Twilio's documentation) speaks espeak μ-law, plays the reply at real time and echoes its marks as
it plays; the caller speaks over the reply and the server clears what it queued; the caller hangs up
and the stream closes cleanly. (What the history keeps of a cut reply: tests/test_phone.py.)"""
from __future__ import annotations

import asyncio

import numpy as np

from load import speech
from load.phone import Phone, ulaw_frames
from tests.e2e.serve_process import PORT


def test_a_call_is_answered_marks_come_back_in_order_and_the_caller_cuts_in(server):
    question = ulaw_frames(speech.padded(speech.espeak("Tell me a long story about the old lighthouse."), 0.2, 0))
    quiet = ulaw_frames(np.zeros(32_000, np.int16))  # 2 s: the turn ends by itself
    cut_in = ulaw_frames(speech.espeak("Wait, stop there please."))

    async def go():
        async with Phone(f"ws://127.0.0.1:{PORT}/v1/phone/twilio") as phone:
            await phone.speak(question)
            await phone.speak(quiet)
            await phone.wait(lambda p: len(p.echoed) >= 3)  # the reply plays; its marks come back as it does
            await phone.speak(cut_in)
            await phone.wait(lambda p: p.clears)
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
