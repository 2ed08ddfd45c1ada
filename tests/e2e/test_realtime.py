"""The OpenAI Realtime endpoint end to end through `serve run serve_config.yaml`, with the clients
people use: the official ``openai`` SDK's realtime client (through ``load.realtime_client``, which
records its events) and the OpenAI Agents SDK's ``RealtimeAgent`` + ``RealtimeRunner``. The same
conversation core serves protocol v1 (tests/e2e/test_serve.py)."""
from __future__ import annotations

import asyncio
import base64
import json
import re
import urllib.request
from typing import Literal

import numpy as np
import pytest
import websockets

from load import speech
from load.realtime_client import RealtimeConversation
from pipeline.audio import float_to_int16, int16_to_float, resample
from pipeline.adapters.realtime.client_events import MAX_APPEND_CHARS
from tests.e2e import observed
from tests.e2e.serve_process import PORT, REALTIME_URL

pytestmark = [pytest.mark.timeout(600),
              pytest.mark.skipif(not speech.available(), reason="needs espeak-ng (scripts/install.sh --system)")]

MAX_GAP_S = 0.5
COMPLETE = "I would like to book a flight to Paris on Friday."  # Smart Turn calls it complete (0.90)
SERVER_VAD = {"type": "server_vad", "silence_duration_ms": 400, "create_response": True, "interrupt_response": True}


def run(coro):
    return asyncio.run(coro)


def check_reply(tr, status="completed"):
    """A reply that ran to its status with audio, every gap between its audio deltas within the limit."""
    assert tr.status == status, tr.types
    kinds = [k for k in tr.types if k.startswith("response.")]
    assert kinds[0] == "response.created" and kinds[-1] == "response.done", kinds
    assert tr.chunks and np.abs(tr.audio.astype(np.int32)).max() > 0
    assert max(tr.gaps, default=0.0) <= MAX_GAP_S, max(tr.gaps)
    assert tr.response_text.strip()


def metric(name: str, **labels) -> float:
    """The sum of a series over this node's processes, as GET /metrics serves it."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{PORT}/metrics", timeout=10).read().decode()
    total = 0.0
    for line in text.splitlines():
        m = re.match(rf"{name}(\{{[^}}]*\}})? ([0-9.e+-]+)$", line)
        if m and all(f'{k}="{v}"' in (m.group(1) or "") for k, v in labels.items()):
            total += float(m.group(2))
    return total


def test_session_update_and_a_typed_turn(server):
    """session.update sets instructions, a voice and manual turns (the session object comes back
    whole, with the model of the URL); a typed turn is answered with audio deltas that decode."""
    async def go():
        async with RealtimeConversation(REALTIME_URL, model="my-agent") as c:
            updated = await c.update({"type": "realtime", "instructions": "You are a pirate. Be brief.",
                                      "audio": {"output": {"voice": "robot"}}, "max_output_tokens": 20})
            tr = await c.say_text("Hello, who are you?")
            return c, updated, tr

    c, updated, tr = run(go())
    assert c.ready["session"]["model"] == "my-agent"
    session = updated["session"]
    assert session["instructions"] == "You are a pirate. Be brief." and session["max_output_tokens"] == 20
    assert session["audio"]["output"]["voice"] == "robot"
    assert session["audio"]["input"]["turn_detection"] is None  # set by the client's first update, kept (merge)
    assert session["audio"]["input"]["format"] == {"type": "audio/pcm", "rate": 24000}
    check_reply(tr, "incomplete")  # the tiny LLM writes until its limit: the session's 20 tokens cut it
    done = c.seen("response.done")[-1]["response"]
    assert done["status_details"] == {"type": "incomplete", "reason": "max_output_tokens"}
    assert done["usage"]["output_tokens"] == 20
    assert done["output"][0]["content"][0]["transcript"] == tr.response_text.strip()
    assert done["audio"]["output"]["voice"] == "robot"
    assert c.errors == []


def test_spoken_turn_under_server_vad(server):
    """Speech at 24 kHz streamed in real time, no commit: the server's VAD hears it start and stop,
    commits the turn, transcribes it and answers it. The session asks for noise_reduction
    near_field (RNNoise in front of the ears), through the official SDK: answered, and the speech
    is heard through it."""
    pcm = speech.espeak(COMPLETE)

    async def go():
        async with RealtimeConversation(REALTIME_URL, session={"audio": {"input": {
                "turn_detection": SERVER_VAD, "noise_reduction": {"type": "near_field"}}}}) as c:
            turn = c._new_turn()  # the reply the server will start by itself
            await c.speak(pcm, until=lambda: turn.done_at)
            return c, turn

    c, tr = run(go())
    kinds = [ev["type"] for _, ev in c.events]
    started, stopped, committed = (kinds.index(k) for k in ("input_audio_buffer.speech_started",
                                                             "input_audio_buffer.speech_stopped",
                                                             "input_audio_buffer.committed"))
    completed = c.seen("conversation.item.input_audio_transcription.completed")
    assert c.seen("session.updated")[-1]["session"]["audio"]["input"]["noise_reduction"] == {"type": "near_field"}
    assert started < stopped < committed < kinds.index("conversation.item.input_audio_transcription.completed")
    item_id = c.seen("input_audio_buffer.committed")[0]["item_id"]
    assert c.seen("input_audio_buffer.speech_started")[0]["item_id"] == item_id
    assert completed[0]["item_id"] == item_id and completed[0]["transcript"].strip()
    assert completed[0]["usage"]["type"] == "duration"
    check_reply(tr)
    assert c.errors == []


def test_manual_turn_commit_and_response_create(server):
    """turn_detection null: audio is appended, committed by the client, and answered only on
    response.create."""
    pcm = speech.espeak("What is the capital of France?")

    async def go():
        async with RealtimeConversation(REALTIME_URL) as c:
            tr = await c.say_audio(pcm)
            return c, tr

    c, tr = run(go())
    assert c.session["audio"]["input"]["turn_detection"] is None
    assert not c.seen("input_audio_buffer.speech_started")  # no VAD events without turn detection
    assert tr.final_text.strip()
    kinds = [ev["type"] for _, ev in c.events]
    assert kinds.index("conversation.item.input_audio_transcription.completed") < kinds.index("response.created")
    check_reply(tr)
    assert c.errors == []


def test_response_cancel(server):
    """response.cancel mid-reply: response.done with status cancelled, no audio of it after."""
    async def go():
        async with RealtimeConversation(REALTIME_URL) as c:
            tr = c._new_turn()
            await c.send({"type": "conversation.item.create", "item": {
                "type": "message", "role": "user", "content": [{"type": "input_text", "text": "Tell me a long story."}]}})
            await c.send({"type": "response.create"})
            await c.wait_for(lambda e: e["type"] == "response.output_audio.delta")
            await c.send({"type": "response.cancel", "event_id": "cancel-1"})
            await c.wait_for(lambda e: e["type"] == "response.done")
            late = await c.say_text("And now?")  # the session goes on
            return c, tr, late

    c, tr, late = run(go())
    assert tr.status == "cancelled" and tr.interrupted
    assert c.seen("response.done")[0]["response"]["status_details"] == {"type": "cancelled", "reason": "client_cancelled"}
    assert tr.types[-1] == "response.done"  # nothing of that response after its done
    check_reply(late)
    assert c.errors == []


def test_barge_in_by_speech_then_truncate(server):
    """Speech over a playing reply cancels it (status cancelled, turn_detected); the client then
    truncates the assistant item to what it played, and the item keeps only that. /metrics counts
    the barge-in and the spoken turn's voice-to-voice as Realtime's, and the call's record has both."""
    pcm = speech.espeak(COMPLETE)
    before = {name: observed.count(name, transport="realtime") for name in ("voice_voice_to_voice_seconds",
                                                                            "voice_barge_in_seconds")}

    async def go():
        async with RealtimeConversation(REALTIME_URL, session={"audio": {"input": {"turn_detection": SERVER_VAD}}}) as c:
            first = c._new_turn()
            await c.send({"type": "conversation.item.create", "item": {
                "type": "message", "role": "user", "content": [{"type": "input_text", "text": "Tell me a long story."}]}})
            await c.send({"type": "response.create"})
            # past the reply's first barge_in_grace_s (0.5 s): with at most 0.3 s sent ahead of real
            # time, 0.9 s of audio received means at least 0.6 s has played
            await c.wait_for(lambda e: first.audio_s >= 0.9)
            second = c._new_turn()
            await c.speak(pcm, until=lambda: second.done_at)
            item_id = c.seen("response.output_item.added", response_id=_response_id(c, first))[0]["item"]["id"]
            await c.send({"type": "conversation.item.truncate", "item_id": item_id, "content_index": 0,
                          "audio_end_ms": 200})
            truncated = await c.wait_for(lambda e: e["type"] in ("conversation.item.truncated", "error"))
            await c.send({"type": "conversation.item.retrieve", "item_id": item_id})
            item = await c.wait_for(lambda e: e["type"] in ("conversation.item.retrieved", "error"))
            return c, first, second, truncated, item

    c, first, second, truncated, item = run(go())
    assert first.status == "cancelled"
    done = [ev for ev in c.seen("response.done") if ev["response"]["id"] == _response_id(c, first)][0]
    assert done["response"]["status_details"]["reason"] == "turn_detected"
    kinds = [ev["type"] for _, ev in c.events]
    assert kinds.index("input_audio_buffer.speech_started") < kinds.index("response.done")  # speech, then the cut
    check_reply(second)
    assert truncated["type"] == "conversation.item.truncated" and truncated["audio_end_ms"] == 200
    kept = item["item"]["content"][0]["transcript"]
    said = done["response"]["output"][0]["content"][0]["transcript"]
    # 200 ms: only the first clause had begun playing
    assert kept and len(kept) < len(first.response_text) and said.startswith(kept)
    assert c.errors == []
    after = {name: observed.count(name, transport="realtime") for name in before}
    assert all(after[name] >= before[name] + 1 for name in before), (before, after)
    rec = observed.record(c.seen("session.created")[0]["session"]["id"], lambda r: len(observed.replies(r)) >= 2)
    assert rec["transport"] == "realtime"
    cut, answer = observed.replies(rec)[:2]
    assert cut["status"] == "cancelled" and cut["barge_in_ms"] > 0 and answer["voice_to_voice_ms"] > 0


def _response_id(c: RealtimeConversation, tr) -> str:
    return next(rid for rid, turn in c._by_response.items() if turn == tr.turn)


def test_mulaw_in_and_out(server):
    """G.711 μ-law at 8 kHz both ways: a spoken turn is heard, and the reply's deltas are μ-law
    bytes, one per 8 kHz sample."""
    pcm = speech.espeak("Can you hear me clearly?")

    async def go():
        async with RealtimeConversation(REALTIME_URL, audio_format="pcmu") as c:
            tr = await c.say_audio(pcm)
            return c, tr

    c, tr = run(go())
    assert c.session["audio"]["input"]["format"] == {"type": "audio/pcmu"}
    assert c.session["audio"]["output"]["format"] == {"type": "audio/pcmu"}
    assert tr.final_text.strip()
    check_reply(tr)
    # (that the μ-law deltas carry the reply's own audio: tests/test_realtime.py compares them with the TTS output)
    assert c.errors == []


BAD_EVENTS = [  # (what, raw frame, error code)
    ("not JSON", "{oops", "invalid_json"),
    ("unknown event type", json.dumps({"type": "sing.a.song", "event_id": "evt-unknown"}), "unknown_event"),
    ("base64 that does not decode", json.dumps({"type": "input_audio_buffer.append", "event_id": "evt-b64",
                                                "audio": "not base64 at all!"}), "invalid_base64"),
    ("session.update with a wrong type", json.dumps({"type": "session.update", "event_id": "evt-type",
                                                     "session": {"instructions": 42}}), "invalid_value"),
    # over this server's append limit, in a message under the door's (bigger ones close with 1009: test_serve.py)
    ("an append over its limit", json.dumps({"type": "input_audio_buffer.append", "event_id": "evt-big",
                                             "audio": "A" * (MAX_APPEND_CHARS + 4)}), "input_audio_buffer_append_too_large"),
]


def test_bad_client_events_get_an_error_naming_their_event_id(server):
    """Each bad event is answered by one error event (OpenAI's shape) naming the event's event_id;
    the session is unchanged and answers a typed turn afterwards."""
    async def go():
        async with websockets.connect(REALTIME_URL, max_size=None) as ws:
            created = json.loads(await ws.recv())
            answers = []
            for _, frame, _ in BAD_EVENTS:
                await ws.send(frame)
                answers.append(json.loads(await asyncio.wait_for(ws.recv(), 30)))
            await ws.send(json.dumps({"type": "conversation.item.create", "item": {
                "type": "message", "role": "user", "content": [{"type": "input_text", "text": "Still there?"}]}}))
            await ws.send(json.dumps({"type": "response.create"}))
            kinds = []
            while not kinds or kinds[-1] != "response.done":
                kinds.append(json.loads(await asyncio.wait_for(ws.recv(), 60))["type"])
            return created, answers, kinds

    created, answers, kinds = run(go())
    assert created["type"] == "session.created"
    for (what, frame, code), answer in zip(BAD_EVENTS, answers):
        assert answer["type"] == "error", what
        assert answer["error"]["code"] == code, (what, answer)
        assert answer["error"]["type"] == "invalid_request_error" and answer["error"]["message"]
        sent_id = None if what == "not JSON" else json.loads(frame).get("event_id")
        assert answer["error"]["event_id"] == sent_id, what
        assert answer["event_id"]  # every server event has its own id
    assert "response.output_audio.delta" in kinds and "error" not in kinds


def test_voice_change_and_own_clips_compile_nothing(server):
    """A configured voice with a reference clip, then the session's own clip at three lengths never
    seen before: every reply plays without a gap over the limit, and the TTS replica meets no
    shape it did not warm (nothing compiles, nothing runs an unseen shape)."""
    clips = {seconds: float_to_int16(resample(int16_to_float(speech.espeak(text)), 16_000, 24_000))
             for seconds, text in ((1, "Hello there."), (2, "This is my own voice, please copy it."),
                                   (3, "I speak slowly and clearly, so that you can learn my voice from me."))}
    unseen_before = metric("voice_unseen_shapes_after_warmup_total", deployment="tts")
    compiles_before = metric("voice_compiles_after_warmup_total")

    async def go():
        async with RealtimeConversation(REALTIME_URL) as c:
            replies = [await c.say_text("Say something in the default voice.")]
            await c.update({"audio": {"output": {"voice": "robot"}}})
            replies.append(await c.say_text("And now in the robot voice."))
            updates = []
            for pcm in clips.values():
                updates.append(await c.update({"audio": {"output": {"voice_clip": {
                    "audio": base64.b64encode(pcm.tobytes()).decode(), "transcript": "my own clip"}}}}))
                replies.append(await c.say_text("Now copy my voice, please."))
            return c, replies, updates

    c, replies, updates = run(go())
    for tr in replies:
        check_reply(tr)
    lengths = sorted(len(p) / 24_000 for p in clips.values())
    assert len({round(s, 2) for s in lengths}) == 3
    for update, pcm in zip(updates, clips.values()):
        clip = update["session"]["audio"]["output"]["voice_clip"]
        assert clip["transcript"] == "my own clip"
        assert clip["seconds"] == pytest.approx(np.ceil(len(pcm) / 1920) * 0.08, abs=0.01)  # 80 ms Mimi frames
    assert metric("voice_unseen_shapes_after_warmup_total", deployment="tts") == unseen_before
    assert metric("voice_compiles_after_warmup_total") == compiles_before
    assert c.errors == []


def test_agents_sdk_holds_a_spoken_conversation(server):
    """The OpenAI Agents SDK's RealtimeAgent and RealtimeRunner, pointed at this server: two spoken
    turns (hands-free: its default semantic_vad is our VAD plus Smart Turn), each answered with
    audio; its history holds both exchanges with the user's words transcribed; its strict
    validation of every server event finds nothing wrong."""
    from agents.realtime import RealtimeAgent, RealtimeRunner

    sentences = [speech.espeak(COMPLETE), speech.espeak("Please tell me the weather in Paris on Friday.")]

    async def go():
        agent = RealtimeAgent(name="assistant", instructions="You are a travel agent. Be brief.")
        runner = RealtimeRunner(agent, config={"model_settings": {"voice": "ash"}})
        session = await runner.run(model_config={"url": f"{REALTIME_URL}?model=gapless", "api_key": "unused"})
        events, ends = [], asyncio.Queue()
        async with session:
            async def listen():
                async for ev in session:
                    events.append(ev)
                    if ev.type == "agent_end":
                        ends.put_nowait(ev)

            listener = asyncio.create_task(listen())
            for pcm in sentences:
                wire = float_to_int16(resample(int16_to_float(pcm), 16_000, 24_000))
                silence = np.zeros(480, np.int16)
                chunks = [wire[i:i + 480] for i in range(0, len(wire), 480)]
                loop = asyncio.get_running_loop()
                t0 = loop.time()
                k = 0
                while ends.empty():  # speech, then silence until the agent has answered
                    chunk = chunks[k] if k < len(chunks) else silence
                    await asyncio.sleep(max(0.0, t0 + (k + 1) * 0.02 - loop.time()))
                    await session.send_audio(chunk.tobytes())
                    k += 1
                    assert k < 3000, "no answer within 60 s"
                await ends.get()
            listener.cancel()
        return events, [ev for ev in events if ev.type == "history_updated"][-1].history

    events, history = run(go())
    kinds = [ev.type for ev in events]
    errors = [ev for ev in events if ev.type == "error"]
    assert errors == [], [str(ev.error)[:300] for ev in errors]
    assert kinds.count("agent_end") >= 2 and kinds.count("audio_end") >= 2
    assert sum(1 for k in kinds if k == "audio") > 4
    users = [item for item in history if getattr(item, "role", None) == "user"]
    bots = [item for item in history if getattr(item, "role", None) == "assistant"]
    assert len(users) == 2 and len(bots) >= 2
    for item in users:
        assert any(getattr(part, "transcript", None) for part in item.content), item
    for item in bots[:2]:
        assert any(getattr(part, "transcript", None) for part in item.content), item


# ----------------------------------------------------------------------------- function calling
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather of a city.", "parameters": {
    "type": "object", "required": ["city"], "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}}}}
ASK_WEATHER = {"type": "conversation.item.create", "item": {
    "type": "message", "role": "user", "content": [{"type": "input_text", "text": "What is the weather in Paris?"}]}}


async def _forced_call(c: RealtimeConversation) -> dict:
    """Ask; the reply (tool_choice required) calls the tool: its arguments' done event, once its
    response is done."""
    first = c._new_turn()
    await c.send(ASK_WEATHER)
    await c.send({"type": "response.create"})
    await c.wait_for(lambda e: e["type"] == "response.done" and first.done_at)
    return c.seen("response.function_call_arguments.done")[-1]


def test_sdk_function_call_output_then_the_spoken_answer(server):
    """The official SDK: response.function_call_arguments.done -> function_call_output +
    response.create -> the answer, spoken."""
    async def go():
        async with RealtimeConversation(REALTIME_URL, session={"tools": [WEATHER], "tool_choice": "required"}) as c:
            call = await _forced_call(c)
            await c.send({"type": "conversation.item.create", "event_id": "out-1", "item": {
                "type": "function_call_output", "call_id": call["call_id"], "output": "Sunny and 21 degrees."}})
            added = await c.wait_for(lambda e: e["type"] == "error" or (
                e["type"] == "conversation.item.added" and e["item"]["type"] == "function_call_output"))
            answer = c._new_turn()
            await c.send({"type": "response.create"})
            await c.wait_for(lambda e: e["type"] == "response.done" and answer.done_at)
            return c, call, added, answer

    c, call, added, answer = run(go())
    assert call["name"] == "get_weather" and json.loads(call["arguments"])["city"] in ("Paris", "Rome")
    first_done = c.seen("response.done")[0]["response"]
    assert [o["type"] for o in first_done["output"]] == ["message", "function_call"]
    assert first_done["output"][1]["call_id"] == call["call_id"] and first_done["output"][1]["status"] == "completed"
    assert added["type"] == "conversation.item.added" and added["item"]["type"] == "function_call_output"
    check_reply(answer)
    assert c.errors == []


def test_barge_in_cancels_a_pending_call_and_its_late_output_is_refused(server):
    """Speech while a call's result is awaited cancels the call: the user's turn is answered, and
    the call's late output is refused (call_cancelled) and not spoken."""
    pcm = speech.espeak(COMPLETE)

    async def go():
        async with RealtimeConversation(REALTIME_URL, session={
                "tools": [WEATHER], "tool_choice": "required", "audio": {"input": {"turn_detection": SERVER_VAD}}}) as c:
            call = await _forced_call(c)
            await c.update({"tool_choice": "auto"})  # the spoken turn's reply needs no tool
            spoken = c._new_turn()
            await c.speak(pcm, until=lambda: spoken.done_at)
            await c.send({"type": "conversation.item.create", "event_id": "late-1", "item": {
                "type": "function_call_output", "call_id": call["call_id"], "output": "Sunny."}})
            refused = await c.wait_for(lambda e: e["type"] == "error" or (
                e["type"] == "conversation.item.added" and e["item"].get("call_id") == call["call_id"]
                and e["item"]["type"] == "function_call_output"))
            created_after = len(c.seen("response.created"))
            return c, spoken, refused, created_after

    c, spoken, refused, created_after = run(go())
    check_reply(spoken)
    assert refused["type"] == "error"
    assert (refused["error"]["code"], refused["error"]["event_id"]) == ("call_cancelled", "late-1")
    assert created_after == 2  # the call's response and the spoken turn's: nothing answers the late output
    c.errors.remove(refused["error"])
    assert c.errors == []


def test_filler_then_the_timeout_reply(server):
    """No output for a call: the filler is said as its own response after tool_filler_after_ms, and
    after the server's tool_timeout_s (10 s in serve_config.yaml) a response says the answer could
    not be had."""
    async def go():
        async with RealtimeConversation(REALTIME_URL, session={
                "tools": [WEATHER], "tool_choice": "required", "tool_filler": "One moment.",
                "tool_filler_after_ms": 300}) as c:
            await _forced_call(c)
            filler, timeout = c._new_turn(), None
            await c.wait_for(lambda e: e["type"] == "response.done" and filler.done_at, timeout=30)
            timeout = c._new_turn()
            await c.wait_for(lambda e: e["type"] == "response.done" and timeout.done_at, timeout=30)
            return c, filler, timeout

    c, filler, timeout = run(go())
    assert filler.response_text == "One moment." and filler.chunks
    assert timeout.response_text == "Sorry, I could not get that answer."
    check_reply(timeout)
    assert timeout.done_at - filler.done_at > 5  # the timeout came seconds after the filler, not with it
    assert c.errors == []


def test_agents_sdk_function_tool_runs_and_the_agent_speaks_after_it(server):
    """The Agents SDK with a @function_tool: the server's forced call reaches the tool (with
    schema-valid arguments), the SDK returns its output, and the agent speaks after it."""
    from agents import function_tool
    from agents.realtime import RealtimeAgent, RealtimeRunner

    ran: list[str] = []

    @function_tool
    def get_weather(city: Literal["Paris", "Rome"]) -> str:
        """The weather of a city."""
        ran.append(city)
        return f"It is sunny in {city}."

    async def go():
        agent = RealtimeAgent(name="assistant", instructions="Use your tool.", tools=[get_weather])
        runner = RealtimeRunner(agent, config={"model_settings": {"tool_choice": "required"}})
        session = await runner.run(model_config={"url": f"{REALTIME_URL}?model=gapless", "api_key": "unused"})
        events = []
        async with session:
            await session.send_message("What is the weather in Paris?")
            async for ev in session:
                events.append(ev)
                kinds = [e.type for e in events]
                if ev.type == "agent_end" and "tool_end" in kinds and "audio" in kinds[kinds.index("tool_end"):]:
                    break  # the answer after the tool has been spoken
                assert len(events) < 5000
        return events

    events = asyncio.run(asyncio.wait_for(go(), 120))
    kinds = [ev.type for ev in events]
    assert [e for e in events if e.type == "error"] == []
    assert len(ran) == 1 and ran[0] in ("Paris", "Rome")
    assert kinds.index("tool_start") < kinds.index("tool_end") < len(kinds) - 1 - kinds[::-1].index("audio")


def test_two_hundred_long_typed_items_cost_other_sessions_nothing(server):
    """One session adds 200 long user items (conversation.item.create, ~1800 characters each, no
    reply asked): its history keeps only max_history_chars of them (the oldest are gone:
    item_not_found), its next reply's prompt stays within the LLM's context, and a fresh session's
    typed turn beside it is answered in full (before the history cap and the O(log n) prompt
    trimming, such a session took the LLM thread for seconds per reply and starved the others)."""
    from pipeline.llm.config import LLMConfig

    long_text = ("Tell me more about the history of the harbour and its old lighthouse keepers, please. " * 21)[:1800]

    async def go():
        async with RealtimeConversation(REALTIME_URL) as flood, RealtimeConversation(REALTIME_URL) as witness:
            await flood.update({"type": "realtime", "audio": {"input": {"turn_detection": None}}})
            for k in range(200):
                await flood.send({"type": "conversation.item.create", "item": {
                    "type": "message", "role": "user", "content": [{"type": "input_text", "text": f"{k}: {long_text}"}]}})
            await flood.wait_for(lambda e: len(flood.seen("conversation.item.added")) >= 200, timeout=120)
            first = flood.seen("conversation.item.added")[0]["item"]["id"]
            await flood.send({"type": "conversation.item.retrieve", "item_id": first, "event_id": "old"})
            gone = await flood.wait_for(lambda e: e["type"] == "error", timeout=30)
            witness_turn, flood_turn = await asyncio.gather(witness.say_text("Hello there."),
                                                            flood.say_text("And what happened next?"))
            return gone, witness_turn, flood_turn, flood.seen("response.done")[-1]["response"], witness.errors

    gone, witness_turn, flood_turn, done, witness_errors = run(go())
    assert (gone["error"]["code"], gone["error"]["event_id"]) == ("item_not_found", "old")
    check_reply(witness_turn, witness_turn.status)
    assert witness_errors == []
    check_reply(flood_turn, flood_turn.status)
    assert 0 < done["usage"]["input_tokens"] <= LLMConfig.tiny().max_context_tokens
