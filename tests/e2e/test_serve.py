"""End to end through real Ray Serve: `serve run serve_config.yaml` (tiny profile, CPU), a real
local Ray cluster, the WebSocket protocol from a client's side."""
from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
import time
import urllib.error
import urllib.request

import msgpack
import numpy as np
import pytest
import websockets
import yaml

from load import speech
from load.client import Conversation, TurnResult
from pipeline.adapters.v1 import protocol as P
from pipeline.audio import speech_like
from tests.e2e import observed
from tests.e2e.serve_process import HANDS_FREE_URL, PORT, ROOT, URL, healthz

# A session setting (docs/protocol.md) for tests about many turns, not long replies: each reply
# is still whole (every clause spoken, response.done), in a fraction of the tiny LLM's 24 tokens.
SHORT_REPLY = 6

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


def check_served_in_full(errors, results):
    """No errors; turns numbered 1..n, each answered in full (text and audio), none interrupted."""
    assert errors == []
    assert [r.turn for r in results] == list(range(1, len(results) + 1))
    for tr in results:
        assert tr.interrupted is False
        check_turn_order(tr)
        check_audio(tr)


def test_health_and_ready(server):
    """/healthz answered 503 while the models were loading (ServeProcess polls it during
    startup and returns at its first 200), then 200 once every model deployment serves."""
    assert server.seen_503, "/healthz never answered 503 before its first 200 during startup"
    assert server.startup_s is not None
    assert healthz() == 200


def test_ten_turn_conversation(server):
    """Typed and spoken turns of different lengths; every turn gets its full response in order."""

    async def talk():
        async with Conversation(URL) as conv:
            assert conv.ready["input_sample_rate"] == 16000
            assert conv.ready["output_sample_rate"] == 24000
            assert (await conv.update(max_output_tokens=SHORT_REPLY))["type"] == "session.updated"
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


def test_four_concurrent_conversations(server):
    """Four sessions talk at once (typed and spoken turns, different lengths): each gets every
    turn in full and in order, with its own transcript, and their first replies overlap in time
    (the sessions are served at once, not one conversation after another; that the TTS batches
    the streams is proven in tests/test_tts_batching.py)."""
    texts = ["Hello there!", "Tell me about the weather.", "What is a fox?", "Book a table, please."]

    async def one(k: int):
        async with Conversation(URL) as conv:
            results = [await conv.say_text(texts[k])]
            results.append(await conv.say_audio(speech_like(1.0 + 0.4 * k, seed=200 + k), chunk_ms=[100, 160, 250, 500][k]))
            results.append(await conv.say_text(texts[(k + 1) % 4]))
            return conv.errors, results

    async def all_four():
        return await asyncio.gather(*(one(k) for k in range(4)))

    sessions = run(all_four())
    for k, (errors, results) in enumerate(sessions):
        assert len(results) == 3
        check_served_in_full(errors, results)
        assert results[0].final_text == texts[k] and results[2].final_text == texts[(k + 1) % 4]
        assert results[1].final_text.strip()
    first_turns = [results[0] for _, results in sessions]
    # every session had audio arriving before any of the four first replies was done
    assert max(tr.chunk_times[0] for tr in first_turns) < min(tr.done_at for tr in first_turns)


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
                # Five rounds spread over the good turn: each waits for the server's error to its
                # round's last frame, so the rounds keep pace with the server, not with a clock.
                for n in range(1, 6):
                    for _, frame, _ in BAD:
                        await bad.send(frame)
                    await bad.wait_for(lambda m: m["type"] == "error" and len(bad.errors) >= n * len(BAD), timeout=60)
            _, tr = await asyncio.gather(spam(), good.say_audio(speech_like(1.5, seed=42)))
            # The server handles a session's frames in order: once the error for a last frame of
            # an unknown type has come, every bad frame's error has come before it.
            await bad.send(msgpack.packb({"type": "are-you-there"}))
            await bad.wait_for(lambda m: m["type"] == "error" and "are-you-there" in m["message"], timeout=60)
            return good, tr, bad

    good, tr, bad = run(go())
    assert good.errors == []
    check_turn_order(tr)
    # one error per bad frame (docs/protocol.md, "Errors"), in the order sent, then the marker's
    assert [e["code"] for e in bad.errors[:-1]] == [code for _, _, code in BAD] * 5
    assert "are-you-there" in bad.errors[-1]["message"]


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


NUM_SLOTS = 8  # STTConfig.tiny().num_slots, the serve_config default


def _session_setting(name: str):
    """A ``session:`` setting of the app the e2e server runs (serve_config.yaml)."""
    cfg = yaml.safe_load((ROOT / "serve_config.yaml").read_text())
    return cfg["applications"][0]["args"]["session"][name]


async def _handled(conv: Conversation) -> None:
    """Return once the server has handled every frame sent so far: it handles a session's frames
    in order, and answers a frame of an unknown type with one error."""
    await conv.send(msgpack.packb({"type": "are-you-there"}))
    await conv.wait_for(lambda m: m["type"] == "error" and m["code"] == P.E_UNKNOWN_TYPE, timeout=60)


def test_idle_sessions_hold_no_recogniser_slot(server):
    """Slots are taken per spoken turn: 20 idle sockets and a speaker all connect, the speaker is
    served, then more sessions than there are slots each speak a turn, one after another, while
    the 20 stay open. (When a session held its slot from connect, the 9th connection was refused.)"""
    assert 21 < _session_setting("max_sessions")

    async def go():
        idle = [Conversation(URL) for _ in range(20)]
        for c in idle:
            await c.__aenter__()
        try:
            async with Conversation(URL) as speaker:
                first = await speaker.say_audio(speech_like(1.5, seed=50), chunk_ms=250)
                speaker_errors = list(speaker.errors)
            for c in idle[: NUM_SLOTS + 1]:
                await c.update(max_output_tokens=SHORT_REPLY)
            turns = [await c.say_audio(speech_like(1.2, seed=60 + i), chunk_ms=250)
                     for i, c in enumerate(idle[: NUM_SLOTS + 1])]
            return first, speaker_errors, turns, [(c.errors, c.closed) for c in idle]
        finally:
            for c in idle:
                await c.__aexit__()

    first, speaker_errors, turns, idle_state = run(go())
    assert speaker_errors == []
    check_turn_order(first)
    check_audio(first)
    assert first.final_text.strip()
    assert len(turns) == NUM_SLOTS + 1
    for tr in turns:
        assert tr.turn == 1
        check_turn_order(tr)
        assert tr.final_text.strip()
    assert idle_state == [([], None)] * 20  # no errors, all still open


def test_slot_exhaustion_keeps_the_session_open(server):
    """Every slot held by an open spoken turn: a new speaker is told no_free_slot once, stays
    open, can type, and is heard once a slot frees."""

    async def go():
        holders = [Conversation(URL) for _ in range(NUM_SLOTS)]
        for c in holders:
            await c.__aenter__()
        try:
            for i, c in enumerate(holders):
                await c.send_audio(speech_like(0.2, seed=i))  # a turn starts and holds its slot
                await _handled(c)
            async with Conversation(URL) as late:
                await late.send_audio(speech_like(0.5, seed=99))
                await _handled(late)
                refused = [e["code"] for e in late.errors]
                typed = await late.say_text("Can you hear me?")
                await holders[0].send(P.client_turn_end())  # a slot frees
                await holders[0].wait_for(lambda m: m["type"] == "response.done" and m["turn"] == 1)
                spoken = await late.say_audio(speech_like(1.2, seed=7), chunk_ms=200)
                late_errors = [e["code"] for e in late.errors]
            return refused, typed, holders[0].turns[1], spoken, late_errors, [c.errors for c in holders]
        finally:
            for c in holders:
                await c.__aexit__()

    refused, typed, freed, spoken, late_errors, holder_errors = run(go())
    assert refused == [P.E_NO_FREE_SLOT, P.E_UNKNOWN_TYPE]  # told during the session, which stayed open
    check_turn_order(typed)
    assert typed.turn == 1 and typed.final_text == "Can you hear me?"
    check_turn_order(freed, expect_reply=False)  # 0.2 s of audio may transcribe to nothing
    check_turn_order(spoken)
    assert spoken.turn == 2 and spoken.final_text.strip()  # the refused turn used no number
    assert late_errors == [P.E_NO_FREE_SLOT, P.E_UNKNOWN_TYPE]
    assert all([e["code"] for e in errs] == [P.E_UNKNOWN_TYPE] for errs in holder_errors)


def _sessions_active() -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{PORT}/metrics", timeout=10).read().decode()
    found = re.search(r"^voice_sessions_active(?:\{[^}]*\})? (\S+)$", text, flags=re.M)
    return float(found.group(1)) if found else 0.0


async def _until_sessions_at_most(n: int, timeout: float = 60) -> None:
    """The server's own count (its /metrics gauge): a closed socket's session ends a moment later."""
    deadline = time.monotonic() + timeout
    while _sessions_active() > n:
        assert time.monotonic() < deadline, f"server still holds more than {n} sessions"
        await asyncio.sleep(0.2)


def test_server_busy_over_max_sessions(server):
    cap = _session_setting("max_sessions")

    async def go():
        await _until_sessions_at_most(0)  # the sessions of earlier tests are gone
        # from 8 loopback addresses, so the replica's cap binds, not the per-client one
        convs = [Conversation(URL, local_addr=(f"127.0.1.{1 + i % 8}", 0)) for i in range(cap)]
        for c in convs:
            await c.__aenter__()
        try:
            async with websockets.connect(URL) as ws:
                first = P.unpack(await asyncio.wait_for(ws.recv(), 30))
                with pytest.raises(websockets.ConnectionClosed):
                    await asyncio.wait_for(ws.recv(), 30)
                close_code = ws.close_code
            tr = await convs[0].say_text("Still fine?")  # the admitted sessions are unaffected
            await convs[-1].__aexit__()
            await _until_sessions_at_most(cap - 1)
            async with Conversation(URL) as again:  # a place freed: admitted
                ready = again.ready
        finally:
            for c in convs[:-1]:
                await c.__aexit__()
        return first, close_code, tr, ready

    first, close_code, tr, ready = run(go())
    assert first["type"] == "error" and first["code"] == P.E_SERVER_BUSY
    assert close_code == P.CLOSE_TRY_AGAIN_LATER
    check_turn_order(tr)
    assert ready["type"] == "session.ready"


HANDS_FREE = ["Please turn off the lights in the kitchen.", "I would like to book a flight to Paris on Friday."]


@pytest.mark.skipif(not speech.available(), reason="needs espeak-ng (scripts/install.sh --system)")
def test_hands_free_conversation_without_turn_end(server):
    """The served default: two spoken turns, real-time microphone audio with silence between,
    no turn.end. The VAD opens each turn, Smart Turn ends it, each is answered in full; the
    client hears speech.started / speech.stopped for each. Then the user speaks over a long reply,
    which stops. The operator sees it: voice-to-voice and barge-in on /metrics as v1's, and the
    call's record keeps each turn with its timings and the cut reply with what was heard."""
    clips = [speech.padded(speech.espeak(t), 0.3, 0.0) for t in HANDS_FREE]
    stop = speech.padded(speech.espeak("Stop."), 0.0, 0.0)
    before = {name: observed.count(name, transport="v1") for name in ("voice_voice_to_voice_seconds",
                                                                      "voice_barge_in_seconds")}

    async def go():
        async with Conversation(HANDS_FREE_URL) as conv:
            results = [await conv.say_hands_free(pcm, speech_end=len(pcm)) for pcm in clips]
            story = await conv.send_text_turn("Tell me a long story about the sea and ships.")
            await conv.wait_for(lambda m: story in conv.turns and conv.turns[story].audio_s >= 0.9)
            cut_in = await conv.say_hands_free(stop, speech_end=len(stop))
            return conv, results, conv.turns[story], cut_in

    conv, results, story, cut_in = run(go())
    check_served_in_full([e for e in conv.errors], results)
    assert all(r.final_text for r in results)
    assert story.interrupted and cut_in.turn == story.turn + 1 and cut_in.final_text
    after = {name: observed.count(name, transport="v1") for name in before}
    assert after["voice_voice_to_voice_seconds"] >= before["voice_voice_to_voice_seconds"] + len(clips) + 1
    assert after["voice_barge_in_seconds"] >= before["voice_barge_in_seconds"] + 1
    rec = observed.record(conv.ready["session_id"], lambda r: len(observed.replies(r)) >= len(clips) + 2)
    assert rec["transport"] == "v1"
    spoken = [t for t in rec["turns"] if t["spoken"]]
    assert [t["user"] for t in spoken[:len(clips)]] == [r.final_text for r in results]
    assert all(t["stt_final_ms"] is not None and t["ended_by"] in ("smart_turn", "silence") for t in spoken)
    answers = [t["replies"][0] for t in spoken]
    assert all(a["voice_to_voice_ms"] > 0 and a["timings"]["first_audio_ms"] > 0 for a in answers)
    cut = next(t for t in rec["turns"] if not t["spoken"])["replies"][0]
    assert cut["status"] == "cancelled" and cut["barge_in_ms"] > 0
    assert cut["heard"] and cut["said"].startswith(cut["heard"].split(".")[0])
    printed = subprocess.run([sys.executable, "-m", "deployments.cli", "record", conv.ready["session_id"]],
                             capture_output=True, text=True, timeout=60)
    assert printed.returncode == 0 and "cut by the caller's speech" in printed.stdout, printed.stderr


def test_bad_session_option_is_refused(server):
    async def go():
        async with websockets.connect(HANDS_FREE_URL + "?turn_detection=sometimes") as ws:
            msg = P.unpack(await asyncio.wait_for(ws.recv(), 30))
            with pytest.raises(websockets.ConnectionClosed):
                await asyncio.wait_for(ws.recv(), 30)
            return msg, ws.close_code

    msg, code = run(go())
    assert msg["type"] == "error" and msg["code"] == P.E_BAD_OPTION and "turn_detection" in msg["message"]
    assert code == P.CLOSE_POLICY_VIOLATION


def test_tool_call_then_result_then_the_spoken_answer(server):
    """Protocol v1's function calling through the running app: tool.call (arguments valid for the
    tool's schema: the call is forced), tool.result, and the reply goes on, spoken, in the same
    turn, ending with one response.done."""
    weather = {"type": "function", "name": "get_weather", "description": "The weather of a city.", "parameters": {
        "type": "object", "required": ["city"], "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}}}}

    async def go():
        async with websockets.connect(URL) as ws:
            msgs = [P.unpack(await ws.recv())]

            async def until(pred):
                while not pred(msgs[-1]):
                    msgs.append(P.unpack(await asyncio.wait_for(ws.recv(), 60)))
                return msgs[-1]

            await ws.send(P.pack({"type": "session.update", "tools": [weather], "tool_choice": "required"}))
            await until(lambda m: m["type"] == "session.updated")
            await ws.send(P.client_text("What is the weather in Paris?"))
            call = await until(lambda m: m["type"] == "tool.call")
            await ws.send(P.pack({"type": "tool.result", "call_id": call["call_id"], "output": "Sunny, 21 degrees."}))
            await until(lambda m: m["type"] == "response.done")
            return msgs, call

    msgs, call = run(go())
    turn = [m for m in msgs if m.get("turn") == 1]
    kinds = [m["type"] for m in turn]
    assert call["name"] == "get_weather" and json.loads(call["arguments"])["city"] in ("Paris", "Rome")
    assert kinds.index("tool.call") < kinds.index("audio") and kinds[-1] == "response.done"
    assert kinds.count("response.done") == 1 and turn[-1]["interrupted"] is False
    assert [m["seq"] for m in turn if m["type"] == "audio"] == list(range(kinds.count("audio")))
    assert not any(m["type"] == "error" for m in msgs)


# ----------------------------------------------------------------------------- the door (issue 25)
def test_a_message_over_the_door_limit_closes_before_it_is_read(server):
    """A 1 MiB WebSocket message is refused by the proxy as its first bytes arrive (1009, message
    too big: deployments/proxy_limits.py), not read and queued for the gateway; a frame over v1's
    64 KiB but under the door's limit still gets v1's frame_too_large; other sessions go on."""
    async def go():
        async with websockets.connect(URL, max_size=None) as ws:
            await ws.recv()  # session.ready
            await ws.send(b"\x00" * (P.MAX_FRAME_BYTES + 1))
            middle = msgpack.unpackb(await ws.recv())
            await ws.send(b"\x00" * (1 << 20))
            with pytest.raises(websockets.ConnectionClosed) as closed:
                while True:
                    await ws.recv()
        async with Conversation(URL) as conv:
            tr = await conv.say_text("Still there?")
        return middle, closed.value.rcvd, tr

    middle, rcvd, tr = run(go())
    assert (middle["type"], middle["code"]) == ("error", P.E_FRAME_TOO_LARGE)
    assert rcvd is not None and rcvd.code == 1009
    check_turn_order(tr)


def _http(path: str, headers: dict | None = None, method: str = "GET") -> tuple[int, dict, bytes]:
    req = urllib.request.Request(f"http://127.0.0.1:{PORT}{path}", headers=headers or {}, method=method)
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read()


def test_the_door_refuses_rebinding_hosts_and_malformed_origins(server):
    """A page on a name rebound to this loopback server (Host: rebound.example) is refused on every
    route, the WebSocket included, though its Origin is its own; a malformed Origin is a 403, not a
    500; /web/ files carry the page's security headers; /openapi.json is not served."""
    rebound = {"Host": "rebound.example:8000", "Origin": "http://rebound.example:8000"}
    statuses = {path: _http(path, rebound)[0] for path in ("/", "/healthz", "/metrics", "/web/index.html")}
    assert statuses == dict.fromkeys(statuses, 403), statuses
    assert json.loads(_http("/", rebound)[2])["code"] == "host_not_allowed"

    async def handshake(headers):
        try:
            async with websockets.connect(URL, additional_headers=headers):
                return 101
        except websockets.InvalidStatus as exc:
            return exc.response.status_code

    assert run(handshake({"Origin": "http://rebound.example:8000", "Host": "rebound.example:8000"})) == 403
    assert run(handshake({"Origin": "http://["})) == 403
    status, headers, _ = _http("/web/index.html")
    assert status == 200
    assert "frame-ancestors 'none'" in headers["content-security-policy"]
    assert headers["x-content-type-options"] == "nosniff"
    assert _http("/openapi.json")[0] == 404
    assert run(handshake({})) == 101  # and an ordinary client still comes in
