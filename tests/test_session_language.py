"""A language per session, on the tiny engines in-process (no Ray), with the multilingual recogniser
and Kyutai's DSM TTS (English and French voices): chosen over v1 (``session.update``), Realtime
(``audio.input.transcription.language``) and a phone agent; refused by name where the recogniser
does not hear it or the voice does not speak it; heard (the session's spoken turns open the
recogniser in that language, whose transcript is the model's own offline pass in that language)
and spoken (a French voice answers typed and spoken turns).

A reply on DSM is one utterance fed clause by clause (tests/test_tts_words.py): no chunk of a
French reply arrives more than 500 ms after the one before (paced to real time, so a stall of the
TTS would show), as the served app's gap test asks of CSM (tests/e2e/test_door.py)."""
from __future__ import annotations

import asyncio
import base64

import numpy as np
import pytest
from scipy.signal import resample_poly

from deployments.app import check_phone_agents, offer_of
from pipeline.adapters.phone.config import read_phone_section
from pipeline.adapters.realtime.adapter import RealtimeSession
from pipeline.adapters.v1 import protocol as P
from pipeline.adapters.v1.adapter import Session
from pipeline.audio import speech_like
from pipeline.llm.config import LLMConfig
from pipeline.services import LLMService, LocalBackends, STTService, TTSService
from pipeline.session_config import SessionConfig
from pipeline.stt.config import STTConfig
from pipeline.stt.reference import offline_tokens
from pipeline.tts.config import TTSConfig
from tests.test_realtime import Wire, send
from tests.test_session import Recorder

STT = STTConfig.tiny(multilingual=True, num_slots=2, endpoint_ms=None)
TTS = TTSConfig.tiny(family="dsm", num_slots=2, voices={
    "default": {"voice": "expresso/ex03-ex01_happy_001_channel1_334s.wav", "languages": ["en"]},
    "marie": {"voice": "cml-tts/fr/2154_2576_000020.wav", "languages": ["fr"]}})
OFFER = offer_of({"stt": STT, "tts": TTS})
MAX_GAP_S = 0.5  # the bar for a reply's audio: no chunk later than this after the one before


@pytest.fixture(scope="module")
def engines():
    return LocalBackends.build(STT, LLMConfig.tiny(max_output_tokens=12), TTS)


class OpenSpy:
    """Real backends; records the language each recogniser stream was opened with."""

    def __init__(self, engines):
        b = engines  # fresh services: their asyncio state belongs to one event loop
        self.inner = LocalBackends(STTService(b.stt.engine, b.stt.thread), LLMService(b.llm.engine, b.llm.thread),
                                   TTSService(b.tts.engine, b.tts.thread))
        self.opened: list[str | None] = []
        self.prompts: list[list[dict]] = []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def llm_stream(self, messages, sampling):
        self.prompts.append(messages)
        return self.inner.llm_stream(messages, sampling)

    async def stt_open(self, sid, language=None):
        self.opened.append(language)
        await self.inner.stt_open(sid, language)


def test_the_offer_is_what_the_recogniser_hears_and_each_voice_speaks():
    assert {"fr", "de", "en", "auto"} <= set(OFFER.heard)
    assert OFFER.voice_languages("marie") == ("fr",) and OFFER.voice_languages("default") == ("en",)
    assert OFFER.voice_languages("alloy") == ("en",)  # an OpenAI name speaks as the voice it aliases


def test_a_v1_session_in_french_is_heard_in_french(engines):
    spy = OpenSpy(engines)
    pcm = speech_like(1.6, seed=21)

    async def go():
        rec = Recorder()
        s = Session(rec, spy, SessionConfig(turn_detection="manual", barge_in="words", echo_cancellation=False,
                                            noise_reduction=None),
                    voices=TTS.voice_names(), offer=OFFER)
        await s.start()
        ready = rec.msgs[0]
        await s.on_frame(P.pack({"type": "session.update", "language": "fr"}))  # the default voice is English
        await s.on_frame(P.pack({"type": "session.update", "language": "ja"}))
        await s.on_frame(P.pack({"type": "session.update", "voice": "marie", "language": "fr"}))
        await s.on_frame(P.pack({"type": "session.update", "voice": "default"}))  # English only: refused
        await s.on_frame(P.pack({"type": "voice.clip", "pcm": np.zeros(2400, "<i2").tobytes(), "text": "Allô.",
                                 "done": True}))  # DSM voices take no clip
        for i in range(0, len(pcm), 1600):
            await s.on_frame(P.client_audio(pcm[i : i + 1600]))
        await s.on_frame(P.client_turn_end())
        await rec.wait(lambda m: m["type"] == "response.done")
        await s.on_frame(P.client_text("Et maintenant, une question écrite."))
        await rec.wait(lambda m: m["type"] == "response.done" and m["turn"] == 2)
        await s.close()
        return ready, rec.msgs, rec.times

    ready, msgs, times = asyncio.run(go())
    assert ready["languages"] == list(OFFER.heard) and ready["voice_languages"]["marie"] == ["fr"]
    errors = [m for m in msgs if m["type"] == "error"]
    assert [e["param"] for e in errors] == ["language", "language", "voice", "voice.clip"]
    assert "marie" in errors[0]["message"] and "'ja' is not heard" in errors[1]["message"]
    assert "voice 'default' speaks ['en'], not 'fr'" in errors[2]["message"] and "no voice clip" in errors[3]["message"]
    assert [m["settings"]["language"] for m in msgs if m["type"] == "session.updated"] == ["fr"]
    assert spy.opened == ["fr"]
    # the LLM is told the language of each reply (its first message, the system's)
    assert spy.prompts and all(p[0]["role"] == "system" and "'fr'" in p[0]["content"] for p in spy.prompts)
    final = next(m for m in msgs if m["type"] == "transcript.final")
    engine = engines.stt.engine
    heard = offline_tokens(engine.model, pcm.astype(np.float32) / 32768.0, "fr")
    assert final["text"] == engine._text(heard)
    assert engine._text(heard) != engine._text(offline_tokens(engine.model, pcm.astype(np.float32) / 32768.0, "de"))
    for turn in (1, 2):  # each reply spoken, by the French voice, with no gap over 500 ms between its chunks
        assert sum(len(m["pcm"]) for m in msgs if m["type"] == "audio" and m["turn"] == turn) > 0.5 * 24_000 * 2, turn
        arrived = [t for m, t in zip(msgs, times) if m["type"] == "audio" and m["turn"] == turn]
        assert max(np.diff(arrived)) <= MAX_GAP_S, (turn, max(np.diff(arrived)))


def test_a_realtime_session_sets_its_language_through_transcription(engines):
    spy = OpenSpy(engines)

    async def go():
        wire = Wire()
        s = RealtimeSession(wire, spy, SessionConfig(turn_detection="manual"), voices=TTS.voice_names(),
                            offer=OFFER)
        await s.start()
        await send(s, type="session.update", session={"audio": {"input": {"transcription": {"language": "xx"}}}})
        await send(s, type="session.update", session={"audio": {"input": {"transcription": {"language": "de"}}}})
        await send(s, type="session.update", session={"audio": {"input": {"transcription": {"language": "fr-CA"}},
                                                                 "output": {"voice": "marie"}}})
        audio24 = resample_poly(speech_like(1.0, seed=22).astype(np.float64), 3, 2).astype("<i2")  # 24 kHz pcm16
        await send(s, type="input_audio_buffer.append", audio=base64.b64encode(audio24.tobytes()).decode())
        await send(s, type="input_audio_buffer.commit")
        await wire.wait("conversation.item.input_audio_transcription.completed")
        await send(s, type="session.update", session={"audio": {"input": {"transcription": None}}})
        kept = s.core.shared.agent.language  # transcription events off; the language stays
        await send(s, type="response.create")  # answered aloud, by the French voice
        await wire.wait("response.done")
        await send(s, type="conversation.item.create", item={"type": "message", "role": "user",
                                                             "content": [{"type": "input_text", "text": "Et ensuite?"}]})
        await send(s, type="response.create")
        await wire.wait("response.done", 2)
        await s.close()
        return wire, kept

    wire, kept = asyncio.run(go())
    assert kept == "fr-CA"
    errors = wire.of("error")
    assert [e["error"]["param"] for e in errors] == ["session.audio.input.transcription.language"] * 2
    assert "'xx' is not heard" in errors[0]["error"]["message"]
    assert "voice 'default' speaks ['en'], not 'de'" in errors[1]["error"]["message"]
    assert wire.of("session.updated")[-2]["session"]["audio"]["input"]["transcription"]["language"] == "fr-CA"
    assert spy.opened == ["fr-CA"]  # the recogniser hears it as French (its primary subtag)
    for done in wire.of("response.done"):  # the spoken turn's reply and the typed turn's, both aloud, no gap over 500 ms
        rid = done["response"]["id"]
        assert sum(len(base64.b64decode(e["delta"])) for e in wire.of("response.output_audio.delta")
                   if e["response_id"] == rid) > 0.5 * 24_000 * 2, rid
        arrived = [t for e, t in zip(wire.events, wire.times)
                   if e["type"] == "response.output_audio.delta" and e["response_id"] == rid]
        assert max(np.diff(arrived)) <= MAX_GAP_S, (rid, max(np.diff(arrived)))


def test_a_phone_agent_in_a_language_no_voice_speaks_stops_the_start():
    phone = read_phone_section({"agents": {"accueil": {"voice": "marie", "language": "fr"},
                                           "empfang": {"language": "de"}}})
    with pytest.raises(ValueError, match="phone agent 'empfang': language: voice 'default' speaks"):
        check_phone_agents(phone, TTS.voice_names(), OFFER)
    ok = read_phone_section({"agents": {"accueil": {"voice": "marie", "language": "fr"}}})
    check_phone_agents(ok, TTS.voice_names(), OFFER)
    assert ok.agents["accueil"].agent_changes()["language"] == "fr"


def test_a_recogniser_offered_a_language_it_does_not_speak_does_not_start(tmp_path):
    from pipeline.stt.engine import STTEngine

    with pytest.raises(ValueError, match=r"offers \['ja'\]"):
        STTEngine.from_config(STTConfig.tiny(multilingual=True, languages=["fr", "ja"], cache_dir=str(tmp_path)))
