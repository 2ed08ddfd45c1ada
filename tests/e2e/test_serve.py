"""End to end through real Ray Serve: `serve run serve_config.yaml` (tiny profile, CPU), a real
local Ray cluster, the WebSocket protocol from a client's side."""
from __future__ import annotations

import asyncio

import msgpack
import numpy as np
import pytest
import websockets

from load.client import Conversation, TurnResult
from pipeline import protocol as P
from pipeline.audio import speech_like
from tests.e2e.serve_process import URL, healthz

pytestmark = pytest.mark.timeout(1500)


def run(coro):
    return asyncio.run(coro)


def check_turn_order(tr, expect_reply=True):
    """partial* -> final -> (text|audio)* -> done, exactly one final and one done."""
    types = tr.types
    assert types.count("transcript.final") == 1, types
    assert types.count("response.done") == 1, types
    assert types[-1] == "response.done", types
    i = types.index("transcript.final")
    assert all(t == "transcript.partial" for t in types[:i]), types
    assert all(t in ("response.text", "audio") for t in types[i + 1 : -1]), types
    if expect_reply:
        assert "response.text" in types and "audio" in types, types


def check_audio(tr):
    audio = tr.audio
    assert audio.dtype == np.dtype("<i2") and len(audio) > 0
    assert all(len(c) > 0 for c in tr.chunks)
    assert np.abs(audio.astype(np.int32)).max() > 0  # not silence


def test_health_and_ready(server):
    assert healthz() == 200


def test_ten_turn_conversation(server):
    """Typed and spoken turns of different lengths; every turn gets its full response in order."""

    async def talk():
        async with Conversation(URL) as conv:
            assert conv.ready["input_sample_rate"] == 16000
            assert conv.ready["output_sample_rate"] == 24000
            results = []
            for i in range(10):
                if i % 2 == 0:
                    results.append(await conv.say_text(["Hello!", "What time is it, please?", "Tell me a story about a fox.",
                                                        "Thanks.", "Could you book a table for two tomorrow evening?"][i // 2]))
                else:
                    pcm = speech_like(0.6 + 0.45 * i, seed=i)  # 1.05 s .. 4.65 s, all different
                    results.append(await conv.say_audio(pcm, chunk_ms=[80, 100, 160, 250, 500][i // 2]))
            return conv, results

    conv, results = run(talk())
    assert conv.errors == []
    assert [r.turn for r in results] == list(range(1, 11))
    for i, tr in enumerate(results):
        assert tr.interrupted is False
        check_turn_order(tr)
        check_audio(tr)
        if i % 2 == 0:
            assert tr.final_text == ["Hello!", "What time is it, please?", "Tell me a story about a fox.",
                                     "Thanks.", "Could you book a table for two tomorrow evening?"][i // 2]
        else:
            assert tr.final_text.strip(), "spoken turns of over a second transcribe to something"


BAD = [
    ("text frame", "not msgpack", P.E_TEXT_FRAME),
    ("oversized", b"\x00" * (P.MAX_FRAME_BYTES + 1), P.E_FRAME_TOO_LARGE),
    ("bad msgpack", b"\xc1\xc1", P.E_BAD_MSGPACK),
    ("not a map", msgpack.packb([1, 2]), P.E_NOT_A_MAP),
    ("missing type", msgpack.packb({"pcm": b"\x00\x00"}), P.E_MISSING_FIELD),
    ("type not str", msgpack.packb({"type": 1}), P.E_WRONG_TYPE),
    ("unknown type", msgpack.packb({"type": "sing"}), P.E_UNKNOWN_TYPE),
    ("audio without pcm", msgpack.packb({"type": "audio"}), P.E_MISSING_FIELD),
    ("pcm wrong type", msgpack.packb({"type": "audio", "pcm": [1, 2]}), P.E_WRONG_TYPE),
    ("pcm odd length", msgpack.packb({"type": "audio", "pcm": b"\x01\x02\x03"}, use_bin_type=True), P.E_BAD_AUDIO),
    ("pcm too long", msgpack.packb({"type": "audio", "pcm": b"\x00" * 40000}, use_bin_type=True), P.E_BAD_AUDIO),
    ("text wrong type", msgpack.packb({"type": "text", "text": b"x"}, use_bin_type=True), P.E_WRONG_TYPE),
    ("text too long", msgpack.packb({"type": "text", "text": "x" * 5000}), P.E_TEXT_TOO_LONG),
]


def test_bad_input_gets_error_and_session_stays_usable(server):
    async def go():
        async with Conversation(URL) as conv:
            codes = []
            for name, frame, code in BAD:
                await conv.send(frame)
                msg = await conv.wait_for(lambda m: m["type"] in ("error", "<closed>"), timeout=30)
                assert msg["type"] == "error", (name, msg)
                assert isinstance(msg["message"], str) and msg["message"]
                codes.append(msg["code"])
            tr = await conv.say_text("Still there?")
            return codes, tr

    codes, tr = run(go())
    assert codes == [code for _, _, code in BAD]
    check_turn_order(tr)
    assert tr.turn == 1  # bad frames opened no turn


def test_bad_input_does_not_touch_other_sessions(server):
    async def go():
        async with Conversation(URL) as good, Conversation(URL) as bad:
            async def spam():
                for _ in range(5):
                    for _, frame, _ in BAD:
                        await bad.send(frame)
                    await asyncio.sleep(0.05)
            _, tr = await asyncio.gather(spam(), good.say_audio(speech_like(1.5, seed=42)))
            return good, tr, bad

    good, tr, bad = run(go())
    assert good.errors == []
    check_turn_order(tr)
    assert len(bad.errors) >= len(BAD)


def test_empty_turn_and_interruption(server):
    async def go():
        async with Conversation(URL) as conv:
            # a turn.end with no audio: an empty turn, final "" and done, no reply
            empty = await conv.say_text("   ")
            conv.turns[2] = TurnResult(2)
            await conv.send(P.client_turn_end())
            await conv.wait_for(lambda m: m["type"] == "response.done" and m["turn"] == 2)
            # a second typed turn right after the first interrupts the first reply
            await conv.send_text_turn("Tell me a long story about the sea and ships.")
            await conv.wait_for(lambda m: m["type"] == "response.text" and m["turn"] == 3)
            second = await conv.say_text("Stop, what time is it?")
            return empty, conv.turns[2], conv.turns[3], second

    empty, empty2, first, second = run(go())
    for tr in (empty, empty2):
        assert tr.types == ["transcript.final", "response.done"] and tr.interrupted is False
    assert empty2.final_text == ""
    assert first.interrupted is True
    assert first.types[-1] == "response.done"  # nothing of turn 3 after its done
    check_turn_order(second)
    assert second.turn == 4 and second.interrupted is False


def test_slot_exhaustion_and_release(server):
    num_slots = 8  # STTConfig.tiny().num_slots, the serve_config default

    async def go():
        convs = [Conversation(URL) for _ in range(num_slots)]
        for c in convs:
            await c.__aenter__()
        async with websockets.connect(URL) as ws:
            msg = P.unpack(await asyncio.wait_for(ws.recv(), 30))
            with pytest.raises(websockets.ConnectionClosed):
                await asyncio.wait_for(ws.recv(), 30)
            close_code = ws.close_code
        # others are unaffected
        tr = await convs[0].say_text("Are you fine?")
        await convs[-1].__aexit__()
        await asyncio.sleep(0.5)
        async with Conversation(URL) as again:  # the disconnected session's slot was freed
            tr2 = await again.say_text("Hi")
        for c in convs[:-1]:
            await c.__aexit__()
        return msg, close_code, tr, tr2

    msg, close_code, tr, tr2 = run(go())
    assert msg["type"] == "error" and msg["code"] == P.E_NO_FREE_SLOT
    assert close_code == P.CLOSE_TRY_AGAIN_LATER
    check_turn_order(tr)
    check_turn_order(tr2)
