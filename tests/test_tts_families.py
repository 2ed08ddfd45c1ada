"""Both TTS families served at once, a family per voice (pipeline/tts/families.py): the serve config's
``tts:`` as a list of a CSM and a DSM entry builds two TTS deployments (the DSM's hash-routed by
utterance), offers both families' voices, and a session's replies go to its voice's family: a clause
per stream on CSM, one utterance fed word by word on DSM, chosen per reply as the session's voice
changes. Two sessions with voices of different families on the same backends at once, tiny engines
in-process."""
from __future__ import annotations

import asyncio

import numpy as np
import pytest
from ray.serve._private.build_app import build_app as built_app

from deployments.app import AppArgs, build_app, configs, offer_of
from deployments.backends import RayBackends
from pipeline.engines import Voice
from pipeline.adapters.v1 import protocol as P
from pipeline.adapters.v1.adapter import Session
from pipeline.llm.config import LLMConfig
from pipeline.runtime.threads import InferenceThread
from pipeline.services import LLMService, LocalBackends, STTService, TTSService, load_llm, load_stt, load_tts
from pipeline.session_config import SessionConfig
from pipeline.stt.config import STTConfig
from tests.test_session import Recorder

MARIE = {"voice": "cml-tts/fr/2154_2576_000020.wav", "languages": ["fr"]}
ARGS = {"auth": {"mode": "none"}, "stt": {"multilingual": True, "num_slots": 2, "endpoint_ms": None},
        "tts": [{"num_slots": 2, "voices": {"robot": {"speaker": 2}}},
                {"family": "dsm", "num_slots": 2, "temperature": 0.0, "voices": {"marie": MARIE}}]}


def test_a_list_of_two_families_is_one_offer_with_a_deployment_per_family():
    built = configs(AppArgs(**ARGS))
    offer = offer_of(built)
    assert (built["tts"].family, built["tts_second"].family) == ("csm", "dsm")
    assert offer.voice_languages("marie") == ("fr",) and offer.voice_languages("robot") == ("en",)
    assert "marie" in offer.word_voices and "robot" not in offer.word_voices and None not in offer.word_voices
    assert offer.takes_clip("robot") and offer.takes_clip("alloy") and not offer.takes_clip("marie")
    app = built_app(build_app(ARGS), name="gapless")
    deps = {d.name: d for d in app.deployments}
    assert {"TTS", "TTS_dsm"} <= set(deps)
    routers = {n: deps[n]._deployment_config.request_router_config.request_router_class for n in ("TTS", "TTS_dsm")}
    assert "ConsistentHash" in str(routers["TTS_dsm"]) and "ConsistentHash" not in str(routers["TTS"])
    assert (deps["TTS"].init_args[0].family, deps["TTS_dsm"].init_args[0].family) == ("csm", "dsm")
    gateway = deps["Gateway"].init_args  # the clause family's handle, and the word family's last
    assert (gateway[2].deployment_name, gateway[-1].deployment_name) == ("TTS", "TTS_dsm")
    assert "marie" in gateway[5] and "robot" in gateway[5] and "default" in gateway[5]


@pytest.mark.parametrize("tts, says", [
    ([{}, {}, {}], "a list of two"),
    ([{}, {"voices": {"robot": {"speaker": 2}}}], "two csm entries"),
    ([{}, {"family": "dsm"}], "names no voice"),
    ([{"voices": {"marie": {"speaker": 2}}}, {"family": "dsm", "voices": {"marie": MARIE}}], "in both entries"),
])
def test_a_bad_list_of_families_stops_the_start_by_name(tts, says):
    with pytest.raises(ValueError, match=says):
        configs(AppArgs(**{**ARGS, "tts": tts}))


class Handle:
    """A deployment handle that records each call: (deployment, method, its options)."""

    def __init__(self, name: str, calls: list):
        self.name, self.calls, self.opts = name, calls, {}

    def options(self, **opts):
        handle = Handle(self.name, self.calls)
        handle.opts = {**self.opts, **opts}
        return handle

    def __getattr__(self, method):
        handle = self

        class Method:
            @staticmethod
            def remote(*args):
                handle.calls.append((handle.name, method, handle.opts))
                return Stream() if handle.opts.get("stream") else asyncio.sleep(0)

        return Method


class Stream:
    def __aiter__(self):
        return self

    async def __anext__(self):
        raise StopAsyncIteration

    def cancel(self):
        pass


def test_a_dsm_first_list_routes_each_voice_to_its_deployment_over_ray():
    args = {**ARGS, "tts": [{"family": "dsm", "num_slots": 2, "voices": {"marie": MARIE}},
                            {"num_slots": 2, "voices": {"robot": {"speaker": 2}}, "voice_aliases": {"bob": "robot"}}]}
    gateway = {d.name: d for d in built_app(build_app(args), name="gapless").deployments}["Gateway"].init_args
    assert (gateway[2].deployment_name, gateway[-1].deployment_name) == ("TTS_csm", "TTS")  # clauses, words
    calls: list = []
    ray = RayBackends(None, None, Handle("TTS_csm", calls), Handle("TTS", calls), offer_of(configs(AppArgs(**args))).word_voices)

    async def go():
        for voice in (None, Voice("alloy"), Voice("marie"), Voice("robot"), Voice("bob")):
            [_ async for _ in ray.tts_stream("Hi.", [], voice)]
        await ray.tts_open("u1", Voice("marie"))
        await ray.tts_feed("u1", [("Bonjour", True)], True)
        await ray.tts_close("u1")

    asyncio.run(go())
    assert [(name, method) for name, method, _ in calls] == [
        ("TTS", "stream"), ("TTS", "stream"), ("TTS", "stream"), ("TTS_csm", "stream"), ("TTS_csm", "stream"),
        ("TTS", "open"), ("TTS", "feed"), ("TTS", "close")]
    assert all(opts.get("session_id") == "u1" for _, method, opts in calls if method != "stream")


@pytest.fixture(scope="module")
def engines():
    built = configs(AppArgs(**ARGS))
    out = {}
    for name, load, cfg in (("stt", load_stt, built["stt"]), ("llm", load_llm, LLMConfig.tiny(max_output_tokens=10)),
                            ("csm", load_tts, built["tts"]), ("dsm", load_tts, built["tts_second"])):
        thread = InferenceThread(name)
        out[name] = (thread.call(load, cfg), thread)
    return out, offer_of(built), built["tts"], built["tts_second"]


class Spy:
    """Both families' services behind one LocalBackends; records each TTS call with its voice."""

    def __init__(self, engines):
        (e, offer, *_) = engines  # fresh services: their asyncio state belongs to one event loop
        self.inner = LocalBackends(STTService(*e["stt"]), LLMService(*e["llm"]), TTSService(*e["csm"]),
                                   words=TTSService(*e["dsm"], label="tts_dsm"), word_voices=offer.word_voices)
        self.calls: list[tuple[str, str]] = []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def tts_stream(self, text, context, voice=None):
        self.calls.append(("stream", voice.name if voice else "default"))
        return self.inner.tts_stream(text, context, voice)

    async def tts_open(self, uid, voice=None):
        self.calls.append(("open", voice.name if voice else "default"))
        await self.inner.tts_open(uid, voice)


def test_each_session_is_spoken_by_its_voices_family(engines):
    _, offer, first, second = engines
    spy = Spy(engines)
    voices = tuple(sorted({*first.voice_names(), "marie"}))

    async def session(*updates):
        rec = Recorder()
        # (four engines share the 2 cores here: a DSM reply's first audio may pass the 1.5 s default)
        cfg = SessionConfig(turn_detection="manual", noise_reduction=None, engine_timeout_s=6.0)
        s = Session(rec, spy, cfg, voices=voices, offer=offer)
        await s.start()
        for turn, update in enumerate(updates, 1):
            await s.on_frame(P.pack({"type": "session.update", **update}))
            if update.get("voice") == "marie":  # a DSM voice takes no clip
                await s.on_frame(P.pack({"type": "voice.clip", "pcm": np.zeros(4800, "<i2").tobytes(),
                                         "text": "Allô.", "done": True}))
            await s.on_frame(P.client_text("Bonjour, une question." if update.get("language") else "Hello there."))
            await rec.wait(lambda m, t=turn: m["type"] == "response.done" and m["turn"] == t)
        await s.close()
        return rec.msgs

    async def both():  # at once, on the same backends
        return await asyncio.gather(session({"voice": "robot"}, {"voice": "marie", "language": "fr"}),
                                    session({"voice": "marie", "language": "fr"}))

    english_then_french, french = asyncio.run(both())
    for msgs, turns in ((english_then_french, (1, 2)), (french, (1,))):
        assert [m.get("param") for m in msgs if m["type"] == "error"] == ["voice.clip"], [m for m in msgs if m["type"] == "error"]
        for turn in turns:  # every reply spoken
            assert sum(len(m["pcm"]) for m in msgs if m["type"] == "audio" and m["turn"] == turn) > 0.3 * 24_000 * 2
    opened = [v for kind, v in spy.calls if kind == "open"]
    streamed = {v for kind, v in spy.calls if kind == "stream"}
    assert opened == ["marie", "marie"]  # the two French replies: one utterance each, on DSM
    assert streamed == {"robot"}  # the English reply: a stream per clause, on CSM


class VoiceChangedMidReply(Spy):
    """An LLM that writes one clause, then waits for ``gate`` before its second."""

    def __init__(self, engines):
        super().__init__(engines)
        self.gate, self.streamed = asyncio.Event(), asyncio.Event()

    def tts_stream(self, text, context, voice=None):
        self.streamed.set()
        return super().tts_stream(text, context, voice)

    async def llm_stream(self, messages, sampling):
        for i, word in enumerate("Hello there, my friend. The sea is calm today, and the sky is clear.".split(" ")):
            if i == 4:
                await self.gate.wait()
            await asyncio.sleep(0)
            yield ("" if i == 0 else " ") + word


def test_a_change_to_a_dsm_voice_mid_reply_takes_the_next_reply_not_the_next_clause(engines):
    _, offer, first, _ = engines
    spy = VoiceChangedMidReply(engines)

    async def go():
        rec = Recorder()
        cfg = SessionConfig(turn_detection="manual", noise_reduction=None, engine_timeout_s=6.0)
        s = Session(rec, spy, cfg, voices=tuple(sorted({*first.voice_names(), "marie"})), offer=offer)
        await s.start()
        await s.on_frame(P.pack({"type": "session.update", "voice": "robot"}))
        await s.on_frame(P.client_text("Hello there."))
        await spy.streamed.wait()  # the first clause went to CSM
        await s.on_frame(P.pack({"type": "session.update", "voice": "marie"}))
        await rec.wait(lambda m: m["type"] == "session.updated" and m["settings"]["voice"] == "marie")
        spy.gate.set()
        await rec.wait(lambda m: m["type"] == "response.done" and m["turn"] == 1)
        spy.gate = asyncio.Event()
        spy.gate.set()
        await s.on_frame(P.client_text("And now?"))
        await rec.wait(lambda m: m["type"] == "response.done" and m["turn"] == 2)
        await s.close()
        return rec.msgs

    msgs = asyncio.run(go())
    assert not [m for m in msgs if m["type"] == "error"]
    # the reply begun in the CSM voice ends in it (a clause per stream); the next is one DSM utterance
    *streams, last = spy.calls
    assert len(streams) >= 2 and set(streams) == {("stream", "robot")} and last == ("open", "marie"), spy.calls
    for turn in (1, 2):
        assert sum(len(m["pcm"]) for m in msgs if m["type"] == "audio" and m["turn"] == turn) > 0.3 * 24_000 * 2
