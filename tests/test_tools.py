"""Function calling on the tiny engines, in-process: forced calls constrained to their schemas, the
model's own call format parsed as it streams, the OpenAI-compatible backend's tool-call deltas, and
the call/result flow of a session (results, filler, timeout, barge-in, bad input). End to end with
the real clients: tests/e2e/test_realtime.py and tests/e2e/test_serve.py."""
from __future__ import annotations

import asyncio
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import jsonschema
import pytest

from pipeline.adapters.v1 import protocol as P
from pipeline.engines import LLMFinish, Sampling, ToolCall
from pipeline.llm import make_llm
from pipeline.llm.config import LLMConfig
from tests.slow_llm import slowed
from pipeline.llm.constraint import CallConstraint
from pipeline.llm.tool_calls import ToolCallParser
from pipeline.runtime.threads import InferenceThread
from pipeline.services import LLMService, LocalBackends, STTService, TTSService
from pipeline.session_config import SessionConfig
from pipeline.stt.config import STTConfig
from pipeline.tts.config import TTSConfig
from pipeline.adapters.v1.adapter import Session
from tests.test_session import Recorder

# Four schemas: a nested object, an enum, an array, number ranges.
TOOLS = [
    {"type": "function", "name": "book_table", "description": "Book a table.", "parameters": {
        "type": "object", "required": ["guest", "when"],
        "properties": {"guest": {"type": "object", "required": ["name", "party"], "properties": {
            "name": {"type": "string", "maxLength": 20}, "party": {"type": "integer", "minimum": 1, "maximum": 12}}},
            "when": {"type": "object", "required": ["day", "hour"], "properties": {
                "day": {"type": "string", "enum": ["mon", "tue", "wed", "thu", "fri"]},
                "hour": {"type": "integer", "minimum": 17, "maximum": 23}}}}}},
    {"type": "function", "name": "set_mood", "description": "Set the lights.", "parameters": {
        "type": "object", "required": ["mood"], "properties": {"mood": {"enum": ["calm", "party", "focus"]}}}},
    {"type": "function", "name": "add_items", "description": "Add to the list.", "parameters": {
        "type": "object", "required": ["items"], "properties": {"items": {
            "type": "array", "minItems": 1, "maxItems": 3, "items": {"type": "string", "maxLength": 12}}}}},
    {"type": "function", "name": "set_thermostat", "description": "Set the heating.", "parameters": {
        "type": "object", "required": ["celsius", "hours"], "properties": {
            "celsius": {"type": "number", "minimum": 15.5, "maximum": 24}, "hours": {"type": "integer", "minimum": 1,
                                                                                     "maximum": 8}}}},
]
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather of a city.", "parameters": {
    "type": "object", "required": ["city"], "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}}}}
ASK = [{"role": "user", "content": "Please do it now."}]


@pytest.fixture(scope="module")
def llm():
    engine = make_llm(LLMConfig.tiny(max_context_tokens=2048))  # four tools' schemas: ~1400 tiny-vocabulary tokens
    engine.warmup()
    return engine


def _forced_calls(llm, tools=TOOLS, n=20) -> list[tuple[dict, str]]:
    """(tool, arguments) of ``n`` forced calls, each named in turn, with different sampling seeds."""
    out = []
    for i in range(n):
        tool = tools[i % len(tools)]
        stream = llm.stream(ASK, Sampling(tools=tuple(tools), tool_choice={"type": "function", "name": tool["name"]}),
                            seed=100 + i)
        items = (parser := ToolCallParser()).push("".join(stream)) + parser.flush()
        calls = [item for item in items if isinstance(item, ToolCall)]
        out.append((tool, calls[0].arguments if calls and calls[0].name == tool["name"] else None))
    return out


def _valid(tool: dict, arguments: str | None) -> bool:
    if arguments is None:
        return False
    try:
        jsonschema.validate(json.loads(arguments), tool["parameters"])
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


def test_forced_calls_always_validate(llm):
    """20 forced calls over the four schemas on the random-weight tiny model: every argument string
    parses and validates against its tool's schema (checked by jsonschema, not by our grammar)."""
    calls = _forced_calls(llm)
    assert [_valid(tool, args) for tool, args in calls] == [True] * 20
    assert len({args for _, args in calls}) > 4  # sampled: not one canned answer per tool


def test_unbounded_values_still_end_within_the_budget(llm):
    """A number of any precision and a string of any length: a random model never stops writing
    digits or letters by itself, so a forced call winds down (only closing tokens, where the grammar
    allows one) after half its token budget: every call still ends, valid, within the budget."""
    tools = [{"type": "function", "name": "note", "parameters": {
        "type": "object", "required": ["value", "text"],
        "properties": {"value": {"type": "number"}, "text": {"type": "string"}}}}]
    calls = _forced_calls(llm, tools, n=8)
    assert [_valid(tool, args) for tool, args in calls] == [True] * 8


def test_without_the_constraint_the_calls_do_not_validate(llm, monkeypatch):
    """Control: the same 20 forced calls with the constraint switched off (mask and grammar state
    do nothing) mostly fail: the validation above can fail, and the constraint is what passes it."""
    monkeypatch.setattr(CallConstraint, "mask", lambda self, logits: None)
    monkeypatch.setattr(CallConstraint, "accept", lambda self, token_id: None)
    calls = _forced_calls(llm)
    assert sum(_valid(tool, args) for tool, args in calls) < 5


def _scripted_logits(llm, text: str, monkeypatch) -> None:
    """Test-only logits bias: the model writes ``text`` (token by token) and then stops."""
    ids = llm.tokenizer.encode(text, add_special_tokens=False) + [llm.tokenizer.eos_token_id]
    forward = llm._forward
    calls = {"n": 0}

    def biased(input_ids, position_ids, cache):
        logits = forward(input_ids, position_ids, cache)
        if input_ids.shape[1] > 1:
            calls["n"] = 0  # a prefill: a new stream starts its script
        logits[ids[min(calls["n"], len(ids) - 1)]] += 1000.0
        calls["n"] += 1
        return logits

    monkeypatch.setattr(llm, "_forward", biased)


def test_auto_parses_the_models_own_call_and_streams_the_text_before_it(llm, monkeypatch):
    """tool_choice auto: the model's own <tool_call> (injected by a logits bias) is parsed from the
    stream; the text before it comes out first, as deltas, and nothing of the tag leaks out."""
    script = 'Sure, let me check that. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    _scripted_logits(llm, script, monkeypatch)
    thread = InferenceThread("llm-tools")

    async def go():
        return [item async for item in LLMService(llm, thread).stream(ASK, Sampling(tools=(WEATHER,), max_output_tokens=200))]

    items = asyncio.run(go())
    thread.shutdown()
    text = "".join(i for i in items if isinstance(i, str))
    calls = [i for i in items if isinstance(i, ToolCall)]
    assert text == "Sure, let me check that. "
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Paris"})]
    assert items.index(calls[0]) > 1  # several text deltas came before the call
    assert isinstance(items[-1], LLMFinish)


# ----------------------------------------------------------------------------- the OpenAI-compatible backend
class ToolUpstream:
    """An OpenAI-style streaming chat endpoint that answers every request with a tool call in
    pieces, as OpenAI's API streams one (id and name first, the arguments in fragments)."""

    def __init__(self, hold_first: bool = False):
        self.requests: list[dict] = []
        self.holding, self.release = threading.Event(), threading.Event()
        upstream, arrivals = self, iter(range(10 ** 6))

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_POST(self):
                upstream.requests.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.end_headers()
                if hold_first and next(arrivals) == 0:
                    upstream.holding.set()
                    upstream.release.wait(30)
                for chunk in CALL_CHUNKS:
                    self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
                    self.wfile.flush()
                self.wfile.write(b"data: [DONE]\n\n")

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.release.set()
        self.server.shutdown()
        self.server.server_close()


def _delta(**delta) -> dict:
    return {"choices": [{"index": 0, "delta": delta, "finish_reason": None}]}


CALL_CHUNKS = [
    _delta(role="assistant", content="One moment."),
    _delta(tool_calls=[{"index": 0, "id": "call_up_1", "type": "function",
                        "function": {"name": "get_weather", "arguments": ""}}]),
    *[_delta(tool_calls=[{"index": 0, "function": {"arguments": piece}}]) for piece in ('{"ci', 'ty": "Pa', 'ris"}')],
    {"choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]},
]


def test_openai_backend_assembles_calls_from_deltas_and_a_slow_upstream_holds_no_one_else():
    upstream = ToolUpstream(hold_first=True)
    engine = make_llm(LLMConfig(backend="openai", openai_url=upstream.url, openai_model="m"))
    thread = InferenceThread("llm-openai-tools")
    service = LLMService(engine, thread)

    async def collect():
        return [item async for item in service.stream(ASK, Sampling(tools=(WEATHER,), tool_choice="required"))]

    async def go():
        held = asyncio.create_task(collect())
        assert await asyncio.to_thread(upstream.holding.wait, 10)
        other = await asyncio.wait_for(collect(), 10)  # served while the first request is held upstream
        still_held = not held.done()
        upstream.release.set()
        return other, still_held, await asyncio.wait_for(held, 10)

    try:
        other, still_held, first = asyncio.run(go())
    finally:
        upstream.close()
        thread.shutdown()
    assert still_held
    for items in (other, first):
        assert items[0] == "One moment."
        assert items[1:] == [ToolCall("call_up_1", "get_weather", '{"city": "Paris"}')]
    sent = upstream.requests[0]
    assert sent["tools"] == [{"type": "function", "function": {
        "name": "get_weather", "description": "The weather of a city.", "parameters": WEATHER["parameters"]}}]
    assert sent["tool_choice"] == "required"


# ----------------------------------------------------------------------------- the flow in a session
@pytest.fixture(scope="module")
def engines():
    return slowed(LocalBackends.build(STTConfig.tiny(num_slots=2, endpoint_ms=None), LLMConfig.tiny(),
                               TTSConfig.tiny()), 0.01)


@pytest.fixture
def backends(engines):
    b = engines
    return LocalBackends(STTService(b.stt.engine, b.stt.thread), LLMService(b.llm.engine, b.llm.thread),
                         TTSService(b.tts.engine, b.tts.thread))


class MemoryConnection:
    """The client's end of a session served by pipeline.connection (so its deadlines run: the
    filler and the timeout)."""

    def __init__(self):
        self.rec = Recorder()
        self.inbox: asyncio.Queue = asyncio.Queue()

    async def receive(self):
        return await self.inbox.get()

    async def send(self, frame):
        await self.rec(frame)

    async def close(self, code, reason):
        self.inbox.put_nowait(None)

    def say(self, msg: dict) -> None:
        self.inbox.put_nowait(P.pack(msg))


class Registry:
    """Keeps the session it was given, for the test to read its history."""

    max_sessions, full, draining = 4, False, False

    def add(self, session):
        self.session = session

    def remove(self, session):
        pass


async def _session(backends, cfg: dict | None = None, **settings):
    """A served v1 session whose agent has the weather tool, forced; ``settings`` more agent settings."""
    from pipeline.connection import serve_connection

    conn, registry = MemoryConnection(), Registry()
    session_cfg = SessionConfig(turn_detection="manual", barge_in="words", pace_lead_s=None, **(cfg or {}))
    task = asyncio.create_task(serve_connection(conn, backends, session_cfg, registry, Session))
    conn.say({"type": "session.update", "tools": [WEATHER], "tool_choice": "required", **settings})
    await conn.rec.wait(lambda m: m["type"] in ("session.updated", "error"))
    return conn, task, registry


async def _call(conn, text: str = "What is the weather in Paris?") -> dict:
    conn.say({"type": "text", "text": text})
    await conn.rec.wait(lambda m: m["type"] == "tool.call")
    return next(m for m in reversed(conn.rec.msgs) if m["type"] == "tool.call")


async def _end(conn, task):
    conn.inbox.put_nowait(None)
    await task


def _turn(rec, turn):
    return [m for m in rec.msgs if m.get("turn") == turn]


def test_call_result_then_the_spoken_answer(backends):
    """v1: tool.call -> tool.result -> the reply goes on with the result and is spoken; one
    response.done for the turn, its audio numbered on; the history holds the call and its output
    in the LLM's format."""
    async def go():
        conn, task, registry = await _session(backends)
        call = await _call(conn)
        conn.say({"type": "tool.result", "call_id": call["call_id"], "output": "Sunny and 21 degrees."})
        await conn.rec.wait(lambda m: m["type"] == "response.done")
        history = registry.session.core.shared.history.messages()
        await _end(conn, task)
        return conn.rec, call, history

    rec, call, history = asyncio.run(go())
    kinds = [m["type"] for m in _turn(rec, 1)]
    assert kinds.count("response.done") == 1 and kinds[-1] == "response.done"
    assert kinds.index("tool.call") < kinds.index("audio")  # the answer is spoken after the call
    assert json.loads(call["arguments"])["city"] in ("Paris", "Rome")
    seqs = [m["seq"] for m in rec.msgs if m["type"] == "audio"]
    assert seqs == list(range(len(seqs)))
    assert [m["role"] for m in history] == ["user", "assistant", "tool", "assistant"]
    assert history[1]["tool_calls"][0]["id"] == call["call_id"] and history[1]["tool_calls"][0]["function"] == {
        "name": "get_weather", "arguments": call["arguments"]}
    assert history[2] == {"role": "tool", "tool_call_id": call["call_id"], "content": "Sunny and 21 degrees."}
    assert rec.errors() == []


def test_filler_then_timeout(backends):
    """No result: after tool_filler_after_ms the filler is said (and kept out of the history); after
    tool_timeout_s the call is cancelled (reason timeout), the reply says it could not get the answer,
    and the turn's response ends; a late result is ignored."""
    async def go():
        conn, task, registry = await _session(backends, {"tool_timeout_s": 1.5}, tool_filler="One moment.",
                                              tool_filler_after_ms=100)
        call = await _call(conn)
        await conn.rec.wait(lambda m: m["type"] == "response.done")
        conn.say({"type": "tool.result", "call_id": call["call_id"], "output": "Too late."})
        conn.say({"type": "text", "text": "Hello?"})  # the session goes on
        await conn.rec.wait(lambda m: m["type"] == "response.done" and m["turn"] == 2)
        history = registry.session.core.shared.history.messages()
        await _end(conn, task)
        return conn.rec, call, history

    rec, call, history = asyncio.run(go())
    turn = _turn(rec, 1)
    kinds = [m["type"] for m in turn]
    text = "".join(m["text"] for m in turn if m["type"] == "response.text")
    cancelled = [m for m in turn if m["type"] == "tool.cancelled"]
    assert cancelled == [{"type": "tool.cancelled", "call_id": call["call_id"], "turn": 1, "reason": "timeout"}]
    assert text == "One moment.Sorry, I could not get that answer."
    i_cancel = kinds.index("tool.cancelled")
    assert "audio" in kinds[:i_cancel] and "audio" in kinds[i_cancel:]  # the filler, then the timeout reply
    assert kinds.count("response.done") == 1 and kinds[-1] == "response.done"
    assert [m["role"] for m in history[:4]] == ["user", "assistant", "tool", "assistant"]
    assert history[2]["content"].startswith("error: no result within 1.5 s")
    assert history[3]["content"] == "Sorry, I could not get that answer."
    assert not any("One moment" in str(m["content"]) for m in history)
    assert rec.errors() == []


def test_a_new_turn_cancels_a_pending_call_and_its_late_result_is_not_spoken(backends):
    async def go():
        conn, task, registry = await _session(backends)
        call = await _call(conn)
        conn.say({"type": "session.update", "tool_choice": "auto"})  # the next reply needs no tool
        conn.say({"type": "text", "text": "Never mind."})
        await conn.rec.wait(lambda m: m["type"] == "transcript.final" and m["turn"] == 2)
        conn.say({"type": "tool.result", "call_id": call["call_id"], "output": "Sunny."})  # too late: ignored
        await conn.rec.wait(lambda m: m["type"] == "response.done" and m["turn"] == 2)
        history = registry.session.core.shared.history.messages()
        await _end(conn, task)
        return conn.rec, call, history

    rec, call, history = asyncio.run(go())
    kinds = [m["type"] for m in rec.msgs]
    i_final2 = next(i for i, m in enumerate(rec.msgs) if m["type"] == "transcript.final" and m["turn"] == 2)
    assert rec.msgs[kinds.index("tool.cancelled")]["reason"] == "cancelled"
    assert kinds.index("tool.cancelled") < i_final2
    assert {"type": "response.done", "turn": 1, "interrupted": True} in rec.msgs[:i_final2]
    assert not any(m.get("turn") == 1 for m in rec.msgs[i_final2:])  # nothing of turn 1 after: not spoken
    tool = next(m for m in history if m["role"] == "tool")
    assert tool["tool_call_id"] == call["call_id"] and tool["content"].startswith("cancelled")
    assert sum(m["role"] == "tool" for m in history) == 1  # the late result was not taken
    assert rec.errors() == []


def test_bad_tool_input_gets_errors_and_the_session_goes_on(backends):
    bad_schema = dict(WEATHER, parameters={"type": "object", "properties": {"city": {"type": "nonsense"}}})

    async def go():
        conn, task, registry = await _session(backends)
        conn.say({"type": "session.update", "tools": [bad_schema]})
        conn.say({"type": "session.update", "tool_choice": {"type": "function", "name": "book_flight"}})
        await conn.rec.wait(lambda _: sum(x["type"] == "error" for x in conn.rec.msgs) >= 2)
        call = await _call(conn)
        conn.say({"type": "tool.result", "call_id": call["call_id"], "output": "x" * (16 * 1024 + 1)})
        conn.say({"type": "tool.result", "call_id": "call_unknown", "output": "?"})  # v1: ignored
        await conn.rec.wait(lambda _: sum(x["type"] == "error" for x in conn.rec.msgs) >= 3)
        conn.say({"type": "tool.result", "call_id": call["call_id"], "output": "Sunny."})  # still pending
        await conn.rec.wait(lambda m: m["type"] == "response.done")
        tools = registry.session.core.shared.agent.tools
        await _end(conn, task)
        return conn.rec, tools

    rec, tools = asyncio.run(go())
    errors = [m for m in rec.msgs if m["type"] == "error"]
    assert [(e["code"], e.get("param")) for e in errors] == [
        ("bad_setting", "tools[0].parameters"), ("bad_setting", "tool_choice"), ("tool_result_too_large", None)]
    assert tools == (WEATHER,)  # the refused updates changed nothing
    assert "audio" in [m["type"] for m in rec.msgs]  # answered once the proper result came
