"""The Realtime adapter and the agent settings on the tiny engines, in-process (no Ray): the session
object's merge and its mapping onto the core, audio formats against an independent reference,
and a voice change reaching the next clause. End to end with the real clients:
tests/e2e/test_realtime.py."""
from __future__ import annotations

import asyncio
import base64
import json
import time
import warnings

import numpy as np
import pytest
from scipy.signal import resample_poly

from pipeline.adapters.v1 import protocol as P
from pipeline.conversation.agent import AgentSettings, BadSetting
from pipeline.conversation import commands as C
from pipeline.engines import Voice
from pipeline.llm.config import LLMConfig
from tests.slow_llm import slowed
from pipeline.adapters.realtime.adapter import RealtimeSession
from pipeline.services import LLMService, LocalBackends, STTService, TTSService
from pipeline.adapters.v1.adapter import Session
from pipeline.session_config import SessionConfig
from pipeline.stt.config import STTConfig
from pipeline.tts.config import TTSConfig
from tests.test_session import Recorder

with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    import audioop

ROBOT = {"speaker": 2, "clip": "voices/robot.wav", "text": "Hello. I am the robot voice, and I speak a little slowly."}
TTS = TTSConfig.tiny(voices={"robot": ROBOT})


@pytest.fixture(scope="module")
def engines():
    # A slow LLM (20 ms a token): a reply's later clauses are still to come while its first one plays.
    return slowed(LocalBackends.build(STTConfig.tiny(num_slots=4, endpoint_ms=None),
                               LLMConfig.tiny(max_output_tokens=40), TTS), 0.02)


@pytest.fixture
def backends(engines):
    b = engines  # fresh services: their asyncio state belongs to one event loop
    return LocalBackends(STTService(b.stt.engine, b.stt.thread), LLMService(b.llm.engine, b.llm.thread),
                         TTSService(b.tts.engine, b.tts.thread))


class TTSSpy:
    """Delegates to real backends; records each TTS call's voice and context and the audio it made.
    With ``tone``, the audio is a speech-band tone of the same length instead: the tiny TTS's random
    weights make a large DC offset with little else, which G.711's coarse steps at high amplitude
    would not carry."""

    def __init__(self, inner, tone: bool = False):
        self.inner = inner
        self.calls: list[dict] = []
        self.tone = tone
        self._t = 0  # samples of tone made so far (its phase runs on across chunks)

    def __getattr__(self, name):
        return getattr(self.inner, name)

    async def tts_stream(self, text, context, voice=None):
        call = {"text": text, "context": list(context), "voice": voice, "pcm": []}
        self.calls.append(call)
        async for pcm, codes in self.inner.tts_stream(text, context, voice):
            if self.tone:
                t = (self._t + np.arange(len(pcm))) / 24_000
                self._t += len(pcm)
                pcm = (4000 * np.sin(2 * np.pi * 310 * t) + 2500 * np.sin(2 * np.pi * 1130 * t)).astype(np.int16)
            call["pcm"].append(pcm)
            yield pcm, codes


class Wire:
    """A Realtime client's side of one in-process session: JSON events both ways."""

    def __init__(self):
        self.events: list[dict] = []
        self.times: list[float] = []  # arrival of each event (monotonic)
        self._arrived = asyncio.Condition()

    async def __call__(self, frame: str) -> None:
        self.events.append(json.loads(frame))
        self.times.append(time.monotonic())
        async with self._arrived:
            self._arrived.notify_all()

    def of(self, kind: str) -> list[dict]:
        return [e for e in self.events if e["type"] == kind]

    async def wait(self, kind: str, count: int = 1, timeout: float = 60) -> None:
        async with self._arrived:
            await asyncio.wait_for(self._arrived.wait_for(lambda: len(self.of(kind)) >= count), timeout)


async def send(s: RealtimeSession, **event) -> None:
    await s.on_frame(json.dumps(event))


def user_text(text: str) -> dict:
    return {"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}


# ----------------------------------------------------------------------------- the session object
def test_updates_merge_and_map_onto_the_core(backends):
    """Partial updates merge deep (a later update keeps what an earlier one set); turn detection
    maps onto the core's settings; a bad update changes nothing and names its field."""
    async def go():
        wire = Wire()
        s = RealtimeSession(wire, backends, SessionConfig(), voices=TTS.voice_names())
        await s.start()
        seen = {"created": (s.core.shared.cfg.turn_detection, s.core.shared.cfg.eot_threshold, s.core.shared.cfg.barge_in)}
        await send(s, type="session.update", session={"instructions": "Be a pirate.", "audio": {"input": {
            "turn_detection": {"type": "server_vad", "silence_duration_ms": 350, "threshold": 0.6,
                               "prefix_padding_ms": 120, "interrupt_response": False, "create_response": False}}}})
        seen["server_vad"] = (s.core.shared.cfg.turn_detection, s.core.shared.cfg.vad_min_silence_ms, s.core.shared.cfg.vad_threshold, s.core.shared.cfg.vad_preroll_ms,
                              s.core.shared.cfg.eot_threshold, s.core.shared.cfg.barge_in, s.core.shared.reply_on_turn_end)
        await send(s, type="session.update", session={"audio": {"output": {"voice": "robot"}}})
        seen["merged"] = (s.core.shared.agent.instructions, s.core.shared.agent.voice, s.core.shared.cfg.vad_min_silence_ms)
        await send(s, type="session.update", session={"audio": {"input": {"turn_detection": {
            "type": "semantic_vad", "eagerness": "high"}}}})
        seen["semantic_vad"] = (s.core.shared.cfg.turn_detection, s.core.shared.cfg.eot_threshold, s.core.shared.cfg.eot_max_silence_ms, s.core.shared.cfg.barge_in)
        await send(s, type="session.update", session={"audio": {"input": {"turn_detection": None}}})
        seen["null"] = (s.core.shared.cfg.turn_detection, s.core.shared.cfg.barge_in, s.core.shared.cfg.vad_events)
        before = (s.describe(), s.core.shared.agent, s.core.shared.cfg)
        await send(s, type="session.update", event_id="bad-1", session={
            "instructions": "Changed?", "audio": {"input": {"turn_detection": {"type": "server_vad", "threshold": 7}}}})
        await send(s, type="session.update", event_id="bad-2", session={"audio": {"output": {"voice": "nobody"}}})
        seen["unchanged"] = before == (s.describe(), s.core.shared.agent, s.core.shared.cfg)
        await s.close()
        return wire, seen

    wire, seen = asyncio.run(go())
    assert seen["created"] == ("vad", 0.5, "vad")  # the server's hands-free defaults: semantic_vad
    assert wire.of("session.created")[0]["session"]["audio"]["input"]["turn_detection"]["type"] == "semantic_vad"
    assert seen["server_vad"] == ("vad", 350.0, 0.6, 120.0, 0.0, "off", False)
    assert seen["merged"] == ("Be a pirate.", "robot", 350.0)
    assert seen["semantic_vad"] == ("vad", 0.3, 800.0, "vad")
    assert seen["null"] == ("manual", "off", False)
    assert seen["unchanged"]
    errors = wire.of("error")
    assert [(e["error"]["event_id"], e["error"]["param"]) for e in errors] == [
        ("bad-1", "session.audio.input.turn_detection.threshold"), ("bad-2", "session.audio.output.voice")]
    updated = wire.of("session.updated")[-1]["session"]
    assert updated["instructions"] == "Be a pirate." and updated["audio"]["output"]["voice"] == "robot"


def test_agent_settings_validate_as_a_whole():
    agent = AgentSettings(instructions="x")
    for changes, param in (({"temperature": 3}, "temperature"), ({"max_output_tokens": 0}, "max_output_tokens"),
                           ({"voice": "nobody"}, "voice"), ({"modalities": ["video"]}, "modalities"),
                           ({"tools": [{"type": "function"}]}, "tools[0].name"), ({"tool_choice": "always"}, "tool_choice"),
                           ({"instructions": 5}, "instructions"), ({"pitch": 1}, "pitch")):
        with pytest.raises(BadSetting) as caught:
            agent.updated({"temperature": 0.5, **changes}, ("default",))
        assert caught.value.param == param
    assert agent.updated({"max_output_tokens": "inf", "temperature": 0}, ("default",)).max_output_tokens is None


# ----------------------------------------------------------------------------- audio formats
def test_mulaw_deltas_carry_the_reply_audio(backends):
    """G.711 μ-law out: the deltas, decoded and brought back to 24 kHz, are the audio the TTS made
    (compared with scipy's resampler, not the one the server uses)."""
    spy = TTSSpy(backends, tone=True)

    async def go():
        wire = Wire()
        s = RealtimeSession(wire, spy, SessionConfig(), voices=TTS.voice_names())
        await send(s, type="session.update", session={"audio": {"output": {"format": {"type": "audio/pcmu"}}}})
        await send(s, type="conversation.item.create", item=user_text("Hello there."))
        await send(s, type="response.create")
        await wire.wait("response.done")
        await s.close()
        return wire

    wire = asyncio.run(go())
    mulaw = b"".join(base64.b64decode(e["delta"]) for e in wire.of("response.output_audio.delta"))
    made = np.concatenate([p for call in spy.calls for p in call["pcm"]]).astype(np.float64)
    assert len(mulaw) == len(made) // 3  # one byte per 8 kHz sample
    heard = np.frombuffer(audioop.ulaw2lin(mulaw, 2), "<i2").astype(np.float64)
    reference = resample_poly(made, 1, 3)
    lag = int(np.argmax(np.correlate(heard[:4000], reference[:4000], "full"))) - 3999  # the resampler's delay
    a, b = (heard[lag:], reference) if lag >= 0 else (heard, reference[-lag:])
    n = min(len(a), len(b))
    assert abs(lag) < 40 and np.corrcoef(a[:n], b[:n])[0, 1] > 0.99


def test_mulaw_input_is_heard_like_pcm(backends):
    """μ-law at 8 kHz in: the core receives the same 16 kHz audio (up to G.711's quantisation and the
    band above 4 kHz) as from the same clip sent as audio/pcm at 24 kHz."""
    from load.realtime_client import encode

    clip = (np.sin(2 * np.pi * 440 * np.arange(16_000) / 16_000) * 8000).astype(np.int16)  # 440 Hz: in both bands
    heard: dict[str, list] = {}

    async def go(fmt: str):
        s = RealtimeSession(Wire(), backends, SessionConfig(), voices=TTS.voice_names())
        await send(s, type="session.update", session={"audio": {"input": {
            "format": {"type": "audio/pcmu"} if fmt == "pcmu" else {"type": "audio/pcm", "rate": 24000},
            "turn_detection": None}}})
        heard[fmt] = []
        do = s.core.do

        async def record(command):
            if isinstance(command, C.Hear):
                heard[fmt].append(command.pcm)
            return await do(command)

        s.core.do = record
        await send(s, type="input_audio_buffer.append", audio=base64.b64encode(encode(clip, fmt)).decode())
        await send(s, type="input_audio_buffer.commit")
        await s.close()

    for fmt in ("pcm", "pcmu"):
        asyncio.run(go(fmt))
    pcm, mu = (np.concatenate(heard[f]).astype(np.float64) for f in ("pcm", "pcmu"))
    assert abs(len(pcm) - 16_000) <= 2 and abs(len(mu) - 16_000) <= 2
    mid = slice(2000, 14_000)  # away from the resamplers' edges
    assert np.corrcoef(pcm[mid], mu[mid])[0, 1] > 0.99


# ----------------------------------------------------------------------------- voices
def test_a_voice_change_mid_reply_reaches_the_next_clause(backends):
    """v1 session.update while a reply speaks: the next clause is made with the new voice (its
    reference clip leads the prompt) and without the old voice's turns in its context."""
    spy = TTSSpy(backends)

    async def go():
        rec = Recorder()
        s = Session(rec, spy, SessionConfig(turn_detection="manual", pace_lead_s=0.1), voices=TTS.voice_names())
        await s.start()
        await s.on_frame(P.client_text("Hello there!"))
        await rec.wait(lambda m: m["type"] == "response.done" and m["turn"] == 1)  # turn 1: the default voice's
        await s.on_frame(P.client_text("Tell me a long story, please."))
        await rec.wait(lambda m: m["type"] == "audio" and m["turn"] == 2)  # its first clause plays
        first_calls = len(spy.calls)
        await s.on_frame(P.pack({"type": "session.update", "voice": "robot"}))
        await rec.wait(lambda m: m["type"] == "response.done" and m["turn"] == 2)
        await s.close()
        return rec.msgs, spy.calls, first_calls

    msgs, calls, first_calls = asyncio.run(go())
    updated = [m for m in msgs if m["type"] == "session.updated"]
    assert updated and updated[0]["settings"]["voice"] == "robot"
    before, after = calls[:first_calls], calls[first_calls:]
    assert after, "the reply had no clause left after the change"
    assert all(c["voice"] is None for c in before) and all(c["voice"] == Voice("robot") for c in after)
    # none of the default voice's turns is context any more: the first clause after the change has no bot
    # turn before it, each later one only the clauses this reply made in the new voice
    for i, call in enumerate(after):
        bots = [seg.text for seg in call["context"] if seg.speaker == 0]
        assert bots == ([" ".join(c["text"] for c in after[:i])] if i else []), (i, bots)
    engine = backends.tts.engine
    robot = engine.voices.voice("robot")
    rows, _ = engine.prompts.segment_rows(robot.reference)
    tokens, _ = engine.build_prompt(after[0]["text"], engine.voices.context(robot, after[0]["context"]), robot.speaker,
                                    reference=robot.reference)
    np.testing.assert_array_equal(tokens[: len(rows)], rows)  # the clip's rows lead the prompt
    # the clip was encoded once at start-up, 80 ms a frame: 4.10 s -> 52 frames (by hand)
    assert len(robot.reference.codes) == 52


def _paths(value, path=()):
    """Every place in a JSON value: its path (keys and indexes) from the top."""
    yield path
    children = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, child in children:
        yield from _paths(child, path + (key,))


def _with(value, path, new):
    """``value`` (deep-copied) with ``new`` at ``path``."""
    if not path:
        return new
    out = json.loads(json.dumps(value))
    at = out
    for key in path[:-1]:
        at = at[key]
    at[path[-1]] = new
    return out


WRONG_TYPES = [None, True, 7, 1.5, "x", [], [1], [{}], {}, {"a": {}}, {"type": {}}, {"id": []}]


def test_a_session_of_wrong_types_at_any_level_is_refused_by_name_never_failing_inside():
    """Every place of a full session object (server_vad and semantic_vad, tools, a voice by id, a
    voice clip), each replaced by every wrong JSON type, on both event dialects: checking it raises
    BadSetting or ClientEventError (the error the client gets), or passes; nothing else. The same
    check serves session.update and a call's session (an offer's, a client secret's)."""
    from pipeline.adapters.realtime.adapter import check_opening_session, refusal
    from pipeline.adapters.realtime.client_events import ClientEventError
    from pipeline.adapters.realtime.session_object import initial

    cfg = SessionConfig()
    full = initial("sess_1", "gapless", cfg)
    full.update(tools=[{"type": "function", "name": "f", "parameters": {"type": "object", "properties": {
        "a": {"type": "string"}}}}], tool_choice={"type": "function", "name": "f"}, max_output_tokens=100,
        temperature=0.5)
    full["audio"]["input"]["turn_detection"] = {"type": "server_vad", "threshold": 0.5, "prefix_padding_ms": 300,
                                                "silence_duration_ms": 500, "create_response": True}
    full["audio"]["output"].update(voice={"id": "robot"}, voice_clip={"audio": "AAAAAA==", "transcript": "hi"})
    semantic = _with(full, ("audio", "input", "turn_detection"), {"type": "semantic_vad", "eagerness": "low"})
    check_opening_session(full, cfg, ("default", "robot"))  # the unchanged ones pass
    check_opening_session(semantic, cfg, ("default", "robot"))
    tried, refused = 0, set()
    for base in (full, semantic):
        for path in _paths(base):
            for wrong in WRONG_TYPES:
                tried += 1
                try:
                    check_opening_session(_with(base, path, wrong), cfg, ("default", "robot"))
                except (BadSetting, ClientEventError) as exc:
                    code, message, param = refusal(exc)
                    assert code and message and param, (path, wrong)
                    refused.add(path)
    assert tried > 500
    deep = json.loads("[" * 500 + "]" * 500)  # parses in ~1 KB; merging it into the session recursed out
    for session, param in (({"prompt": deep}, "session"),
                           ({"tools": [{"type": "function", "name": "f", "parameters": {"x": deep}}]}, "tools")):
        with pytest.raises(BadSetting) as too_deep:
            check_opening_session(session, cfg, ("default", "robot"))
        assert too_deep.value.param == param and "levels deep" in too_deep.value.message
    # wrong types where the protocol has a type are refused there, not accepted
    for path in [("audio",), ("audio", "input"), ("audio", "input", "format", "type"), ("instructions",),
                 ("audio", "input", "turn_detection", "eagerness"), ("tools", 0, "parameters"), ("tool_choice",)]:
        assert path in refused or path[:-1] in refused, path
