"""Turn taking with the real small models: Silero VAD, Smart Turn v3.2, WebRTC echo cancellation,
and hands-free sessions on the tiny engines (no Ray). Test speech is made by espeak-ng here,
so where it starts and ends is known to the sample (load/speech.py)."""
from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

from load import speech
from load.backchannels import Oracle
from load.speakerphone import Speakerphone
from pipeline.adapters.v1 import protocol as P
from pipeline.conversation.observer import Observer
from pipeline.conversation.ears.echo import EchoCanceller
from pipeline.conversation.ears.listening import Listener
from pipeline.llm.config import LLMConfig
from tests.slow_llm import slowed
from pipeline.services import LocalBackends
from pipeline.adapters.v1.adapter import Session
from pipeline.session_config import SessionConfig
from pipeline.conversation.ears.smart_turn import shared_model as smart_turn
from pipeline.conversation.turns import EOT_RECHECK_MS
from pipeline.stt.config import STTConfig
from pipeline.tts.config import TTSConfig
from pipeline.conversation.ears.vad import VADSettings, VoiceActivity

pytestmark = pytest.mark.skipif(not speech.available(), reason="needs espeak-ng (scripts/install.sh --system)")

RATE = 16_000
COMPLETE = "I would like to book a flight to Paris on Friday."
HALF = "I would like to book a flight to"  # Smart Turn: 0.01-0.02 (measured), a pause mid-sentence


@pytest.fixture(scope="module")
def sentence():
    return speech.espeak(COMPLETE)


def _events(pcm: np.ndarray, frame: int = 320, **settings) -> list:
    vad = VoiceActivity(VADSettings(**settings))
    out = []
    for i in range(0, len(pcm), frame):
        out += vad.push(pcm[i:i + frame])
    return out


# ----------------------------------------------------------------------------- the models
def test_vad_probabilities_match_silero_own_wrapper(sentence):
    """Our per-stream state feeding gives exactly the probabilities silero-vad's own OnnxWrapper gives."""
    import torch
    from silero_vad import load_silero_vad

    audio = speech.padded(sentence, 0.3, 0.3)
    ref = load_silero_vad(onnx=True)
    x = torch.from_numpy(audio.astype(np.float32) / 32768.0)
    expected = [ref(x[i:i + 512], RATE).item() for i in range(0, len(x) - 511, 512)]
    vad = VoiceActivity(VADSettings())
    got = []
    for i in range(0, len(audio) - 511, 512):
        vad.push(audio[i:i + 512])
        got.append(vad.last_prob)
    np.testing.assert_allclose(got, expected, rtol=0, atol=1e-5)
    assert max(got) > 0.9 and min(got) < 0.1  # speech and silence are both in it


@pytest.mark.parametrize("frame", [160, 320, 512, 1600])
def test_vad_events_at_known_speech_boundaries(sentence, frame):
    before, after = 0.7, 1.0
    events = _events(speech.padded(sentence, before, after), frame=frame)
    assert [e.kind for e in events] == ["speech.started", "speech.stopped"]
    onset, end = before * RATE, before * RATE + len(sentence)
    assert abs(events[0].sample - onset) <= 0.064 * RATE
    assert abs(events[1].sample - end) <= 0.064 * RATE


def test_vad_pause_shorter_than_min_silence_is_one_speech():
    clip = speech.with_pauses([HALF, "Paris on Friday."], pause_s=0.5)
    assert [e.kind for e in _events(speech.padded(clip, 0.5, 1.0), min_silence_ms=700)] == \
        ["speech.started", "speech.stopped"]
    assert [e.kind for e in _events(speech.padded(clip, 0.5, 1.0), min_silence_ms=200)] == \
        ["speech.started", "speech.stopped"] * 2


def test_vad_ignores_silence_and_noise():
    rng = np.random.default_rng(0)
    assert _events(np.zeros(3 * RATE, np.int16)) == []
    assert _events((rng.standard_normal(3 * RATE) * 300).astype(np.int16)) == []


def test_smart_turn_half_sentence_incomplete_whole_complete(sentence):
    model = smart_turn()
    whole = model.probability(speech.padded(sentence, 0.3, 0.2))
    half = model.probability(speech.padded(speech.espeak(HALF), 0.3, 0.2))
    assert whole > 0.5 > half


def test_smart_turn_equals_pipecat_analyzer(sentence):
    """The same number pipecat's own LocalSmartTurnAnalyzerV3 computes on the same audio."""
    from pipecat.audio.turn.smart_turn.local_smart_turn_v3 import LocalSmartTurnAnalyzerV3

    ref = LocalSmartTurnAnalyzerV3()
    for clip in (speech.padded(sentence, 0.3, 0.2), speech.padded(speech.espeak(HALF), 0.3, 0.2),
                 speech.padded(np.tile(sentence, 4), 0.0, 0.2)):  # over 8 s: the last 8 s count
        expected = ref._predict_endpoint(clip.astype(np.float32) / 32768.0)["probability"]
        assert smart_turn().probability(clip) == pytest.approx(expected, abs=1e-6)


# ----------------------------------------------------------------------------- echo
class TurnEnds(Observer):
    """An observer that keeps what ended each turn."""

    def __init__(self, ended_by: list):
        self.ended_by = ended_by

    def turn_ended(self, by: str) -> None:
        self.ended_by.append(by)


def _speakerphone(reply_16k: np.ndarray, delay_s: float = 0.15, gain_db: float = -10) -> np.ndarray:
    d = int(delay_s * RATE)
    return np.concatenate([np.zeros(d), reply_16k * 10 ** (gain_db / 20)])


def _listen(mic: np.ndarray, reply_24k: np.ndarray | None, echo_cancellation: bool, frame: int = 320):
    """A listener that sent ``reply_24k`` (as one reply, at the start) and then heard ``mic``."""
    ears = Listener(VADSettings(), echo_cancellation=echo_cancellation)
    if reply_24k is not None:
        for i in range(0, len(reply_24k), 1920):
            ears.reference(reply_24k[i:i + 1920])
    events = []
    for i in range(0, len(mic), frame):
        events += ears.hear(mic[i:i + frame].astype(np.int16))
    return events


@pytest.fixture(scope="module")
def bot_reply():
    """The bot's reply: espeak speech (so a VAD hears it as speech), at 24 kHz as the TTS sends it."""
    from pipeline.audio import float_to_int16, int16_to_float, resample

    reply_16k = speech.padded(speech.espeak("Hello there, I am your assistant and I can tell you about the "
                                            "weather and the trains to Lyon today."), 0.0, 0.5)
    return reply_16k, float_to_int16(resample(int16_to_float(reply_16k), RATE, 24_000))


def test_echo_of_the_reply_is_not_speech(bot_reply):
    reply_16k, reply_24k = bot_reply
    mic = np.clip(_speakerphone(reply_16k.astype(np.float64)), -32768, 32767)
    assert _listen(mic, reply_24k, echo_cancellation=False)  # without it, the echo is speech
    assert _listen(mic, reply_24k, echo_cancellation=True) == []


def test_person_over_the_echo_is_still_heard(bot_reply):
    reply_16k, reply_24k = bot_reply
    person = speech.espeak("Stop, wait a moment please.")
    mic = _speakerphone(reply_16k.astype(np.float64))
    onset = 2 * RATE
    mic[onset:onset + len(person)] += person
    events = _listen(np.clip(mic, -32768, 32767), reply_24k, echo_cancellation=True)
    started = [e.sample for e in events if e.kind == "speech.started"]
    assert started and 0 <= started[0] - onset <= 0.4 * RATE


def _listen_paced(mic: np.ndarray, reply_24k: np.ndarray, lead_s: float = 0.3, frame: int = 320):
    """A listener whose reply is sent as a session paces it (``lead_s`` ahead of the microphone
    clock, from its first chunk at microphone sample 0) while it hears ``mic``."""
    ears = Listener(VADSettings(), echo_cancellation=True)
    events, sent = [], 0
    for i in range(0, len(mic), frame):
        while sent < len(reply_24k) and sent / 24_000 < i / RATE + lead_s:
            ears.reference(reply_24k[sent:sent + 1920])
            sent += 1920
        events += ears.hear(np.clip(mic[i:i + frame], -32768, 32767).astype(np.int16))
    return events, ears


@pytest.mark.parametrize("echo", [False, True], ids=["headset", "speakerphone"])
@pytest.mark.parametrize("onset_s", [0.0, 0.1])
def test_person_at_the_replys_first_chunk_is_heard_at_once(bot_reply, echo, onset_s):
    """A person who speaks as the reply starts is heard as soon as one with no reply playing (VAD
    onset ~0.1 s): AEC3, not yet knowing the echo path, held them back 0.58-0.83 s; the
    canceller's check hears a microphone the reply does not explain and lets the raw audio
    through. The same espeak voice as the reply's (the worst case for a chance likeness) is not
    taken for its echo."""
    reply_16k, reply_24k = bot_reply
    person = speech.espeak("Stop, wait a moment please.")
    mic = _speakerphone(reply_16k.astype(np.float64))[:3 * RATE] if echo else np.zeros(3 * RATE)
    onset = int(onset_s * RATE)
    mic[onset:onset + len(person)] += person[:len(mic) - onset]
    events, ears = _listen_paced(mic, reply_24k)
    started = [e.sample for e in events if e.kind == "speech.started"]
    assert started and 0 <= started[0] - onset <= 0.2 * RATE, started
    assert ears.echo.echo_heard is echo


@pytest.mark.parametrize("onset", [800, 2400, 4000, 5600])
def test_a_person_heard_stays_heard_through_a_chance_likeness(bot_reply, onset):
    """A headset, a person speaking over the reply's first half second in the reply's own voice: one
    check's chance peak (0.29-0.40, at some delay) does not hand the VAD the cancelled audio, which
    AEC3 holds back (a barge-in 0.62 s late in CI); only a peak seen again at its delay does. These
    onsets each flipped it with a single peak."""
    _, reply_24k = bot_reply
    person = speech.espeak("Stop, wait a moment please.")
    mic = np.zeros(3 * RATE)
    mic[onset:onset + len(person)] += person[:len(mic) - onset]
    ears = Listener(VADSettings(), echo_cancellation=True)
    sent, heard_at, cancelled = 0, None, []
    for i in range(0, len(mic), 320):
        while sent < len(reply_24k) and sent / 24_000 < i / RATE + 0.2:
            ears.reference(reply_24k[sent:sent + 1920])
            sent += 1920
        ears.hear(mic[i:i + 320].astype(np.int16))
        if heard_at is None and ears.echo.person_heard:
            heard_at = i
        if heard_at is not None and i < onset + RATE // 2 and ears.echo.use_cancelled:
            cancelled.append(i)
    assert heard_at is not None and heard_at - onset <= 0.15 * RATE, heard_at
    assert cancelled == []


def test_echo_alone_from_the_replys_first_chunk_is_not_speech(bot_reply):
    reply_16k, reply_24k = bot_reply
    events, ears = _listen_paced(_speakerphone(reply_16k.astype(np.float64)), reply_24k)
    assert events == [] and ears.echo.echo_heard


def test_the_echo_of_a_paused_reply_resumed_is_not_speech(bot_reply):
    """A speakerphone; the reply is paused 1.5 s in (resume_false_interruption) and resumes 0.8 s
    later: the client plays what it held first, then the rest. The held audio's echo is cancelled
    too (its reference laid again from the resume): without that it barged in."""
    reply_16k, reply_24k = bot_reply
    paused_at, pause = int(1.5 * RATE), int(0.8 * RATE)
    played = np.concatenate([reply_16k[:paused_at], np.zeros(pause), reply_16k[paused_at:]])
    mic = _speakerphone(played.astype(np.float64))
    ears = Listener(VADSettings(), echo_cancellation=True)
    events, sent, lead = [], 0, int(0.3 * RATE)
    for i in range(0, len(mic), 320):
        if i == paused_at:
            ears.stop_playback(hold=True)
        if i == paused_at + pause:
            ears.resume_playback()
        playing = i + lead if i < paused_at else paused_at + lead + max(0, i - paused_at - pause) if i >= paused_at + pause else None
        while playing is not None and sent < len(reply_24k) and sent * 2 // 3 < playing:
            ears.reference(reply_24k[sent:sent + 1920])
            sent += 1920
        events += ears.hear(np.clip(mic[i:i + 320], -32768, 32767).astype(np.int16))
    assert ears.echo.echo_heard and events == []


def test_echo_canceller_passes_audio_untouched_when_nothing_plays(sentence):
    out = EchoCanceller().process(sentence)
    n = len(sentence) // 160 * 160
    np.testing.assert_array_equal(out, sentence[:n])


# ----------------------------------------------------------------------------- sessions
@pytest.fixture(scope="module")
def engines():
    return slowed(LocalBackends.build(STTConfig.tiny(num_slots=4, endpoint_ms=None),
                               LLMConfig.tiny(max_output_tokens=40), TTSConfig.tiny()), 0.02)


class Recorder:
    def __init__(self):
        self.msgs: list[dict] = []
        self._arrived = asyncio.Condition()

    async def __call__(self, frame: bytes) -> None:
        await self.record(P.unpack(frame))

    async def record(self, msg: dict) -> None:
        self.msgs.append(msg)
        async with self._arrived:
            self._arrived.notify_all()

    def of(self, kind: str) -> list[dict]:
        return [m for m in self.msgs if m["type"] == kind]

    async def wait(self, pred, timeout: float = 60) -> None:
        async with self._arrived:
            await asyncio.wait_for(self._arrived.wait_for(lambda: pred(self)), timeout)


async def _stream(s: Session, pcm: np.ndarray, frame: int = 320) -> None:
    for i in range(0, len(pcm), frame):
        await s.on_frame(P.client_audio(pcm[i:i + frame]))


def test_hands_free_turns_without_turn_end(engines, sentence):
    """Two utterances, the first with a 500 ms pause mid-sentence, no turn.end: two turns (the
    pause does not cut the first), each answered; the silence between them takes no turn."""
    paused = speech.with_pauses([HALF, "Paris on Friday."], pause_s=0.5)
    second = speech.espeak("Please turn off the lights in the kitchen.")
    audio = np.concatenate([speech.padded(paused, 0.5, 1.0), speech.padded(second, 0.3, 1.0)])

    async def go():
        rec = Recorder()
        s = Session(rec, engines, SessionConfig(pace_lead_s=None, barge_in="off"), observer=TurnEnds(ended_by))
        await s.start()
        await _stream(s, audio)
        await rec.wait(lambda r: len(r.of("response.done")) == 2)
        await s.close()
        return rec, s

    ended_by: list[str] = []
    rec, s = asyncio.run(go())
    assert ended_by == ["smart_turn", "smart_turn"]
    finals = rec.of("transcript.final")
    assert [m["turn"] for m in finals] == [1, 2]
    assert [m["turn"] for m in rec.of("response.done")] == [1, 2]
    kinds = [m["type"] for m in rec.msgs if m["type"].startswith("speech.")]
    assert kinds == ["speech.started", "speech.stopped"] * 3  # the pause, the first end, the second end
    probs = s.core.turns.eot_probabilities
    at_pause = [p for p in probs if p < 0.5]
    assert at_pause and probs[:len(at_pause)] == at_pause  # the pause, judged as it grew: incomplete each time
    assert all(p >= 0.5 for p in probs[len(at_pause):])  # then each end of the sentences: complete


def test_a_finished_sentence_smart_turn_doubts_at_first_ends_as_the_silence_grows(engines):
    """Smart Turn's verdict on a finished sentence can be low when the pause begins and rise as the
    silence after it grows (espeak's "...to a new flat.": 0.08 at 200 ms, over 0.5 by 500 ms):
    judged again every EOT_RECHECK_MS, the turn ends then, not at eot_max_silence_ms."""
    clip = speech.padded(speech.espeak("I need to change my address, I moved last month to a new flat."), 0.3, 1.8)

    async def go():
        rec = Recorder()
        s = Session(rec, engines, SessionConfig(pace_lead_s=None, barge_in="off"), observer=TurnEnds(ended_by))
        await s.start()
        await _stream(s, clip)
        await rec.wait(lambda r: r.of("response.done"))
        await s.close()
        return rec, s

    ended_by: list[str] = []
    rec, s = asyncio.run(go())
    probs = s.core.turns.eot_probabilities
    assert ended_by == ["smart_turn"] and [m["turn"] for m in rec.of("transcript.final")] == [1]
    assert probs[0] < 0.5 <= probs[-1]  # doubted at the pause, complete as it grew
    assert len(probs) <= 1 + (SessionConfig().eot_max_silence_ms - SessionConfig().vad_min_silence_ms) / EOT_RECHECK_MS


def test_hands_free_silence_is_no_turn_and_takes_no_slot(engines):
    async def go():
        rec = Recorder()
        s = Session(rec, engines, SessionConfig())
        await s.start()
        await _stream(s, np.zeros(3 * RATE, np.int16))
        slots = engines.stt.stats()["active_streams"]
        await s.close()
        return rec, slots

    rec, slots = asyncio.run(go())
    assert [m["type"] for m in rec.msgs] == ["session.ready"] and slots == 0


class Doubting:
    """Smart Turn as it judges a turn, every verdict "incomplete" (what the real model said is kept in
    ``real``): the silence rule under test, whatever the model makes of a half sentence as the silence
    after it grows (one espeak-ng build's half sentence rose to 0.52 at 600 ms of silence)."""

    def __init__(self):
        self.real: list[float] = []

    async def probability_async(self, pcm):
        self.real.append(await smart_turn().probability_async(pcm))
        return 0.0


def test_incomplete_pause_ends_the_turn_after_max_silence(engines):
    """A half sentence and then silence: Smart Turn says incomplete, the turn ends anyway once the
    silence reaches eot_max_silence_ms, also when the client stops sending (the wall-clock side)."""
    half = speech.padded(speech.espeak(HALF), 0.5, 0.4)

    async def go(streamed_silence: bool):
        rec = Recorder()
        s = Session(rec, engines, SessionConfig(pace_lead_s=None, eot_max_silence_ms=800),
                    observer=TurnEnds(ended_by), smart_turn=doubting)
        await s.start()
        await _stream(s, half)
        assert not rec.of("transcript.final")  # 400 ms of silence: past speech.stopped, under 800 ms
        if streamed_silence:
            await _stream(s, speech.silence(0.6))
        else:
            await asyncio.sleep(max(0.0, s.next_deadline() - time.monotonic()))  # the pause's deadline itself
            await s.check_deadlines()
        await s.close()
        return rec, s

    for streamed in (True, False):
        ended_by: list[str] = []
        doubting = Doubting()
        rec, s = asyncio.run(go(streamed))
        assert s.core.turns.eot_probabilities and doubting.real[0] < 0.5  # the real model doubts it too, at first
        assert [m["turn"] for m in rec.of("transcript.final")] == [1] and ended_by == ["silence"]


class SpeechVoice:
    """The tiny engines, with the reply's audio replaced by espeak speech (the tiny TTS's random
    weights do not sound like speech, so its echo would prove nothing): a reply a VAD hears."""

    def __init__(self, inner, voice_24k: np.ndarray):
        self.inner, self.voice, self.at = inner, voice_24k, 0

    def __getattr__(self, name):
        return getattr(self.inner, name)

    async def tts_stream(self, text, context):
        async for pcm, codes in self.inner.tts_stream(text, context):
            piece = self.voice[self.at:self.at + len(pcm)]
            self.at = (self.at + len(pcm)) % (len(self.voice) - len(pcm))
            yield piece, codes


class PhoneRecorder(Recorder):
    """A client on a speakerphone: received audio plays and comes back into its microphone.

    Playback and capture run on one device clock, as on a real phone: a chunk starts playing at
    the microphone position the client has reached (``mic_sent`` samples sent), not at the wall
    time it arrived. On a loaded machine this test's loop runs behind the wall clock; with wall
    time the echo landed as far behind the reference as the loop was late (over 500 ms once in
    CI, past the delays the echo check looks at), an artefact of the harness, not of a phone."""

    def __init__(self, phone: Speakerphone):
        super().__init__()
        self.phone = phone
        self.mic_sent = 0

    def _now(self) -> float:
        return self.phone.t0 + self.mic_sent / RATE

    async def __call__(self, frame: bytes) -> None:
        msg = P.unpack(frame)
        await self.record(msg)
        if msg["type"] == "audio":
            self.phone.receive(np.frombuffer(msg["pcm"], "<i2"), self._now())
        elif msg["type"] == "response.done" and msg["interrupted"]:
            self.phone.flush(self._now())


@pytest.mark.parametrize("case", ["echo", "echo_without_canceller", "person_over_echo", "person_at_first_chunk",
                                  "headset_person_at_first_chunk"])
def test_barge_in_by_voice_and_not_by_echo(engines, bot_reply, case):
    """Real time, speakerphone client: the reply's echo (-10 dB, 150 ms) does not interrupt it
    while the echo canceller runs, its first chunks included (and does without it: the check can
    fail); a person speaking over the reply does interrupt it, ~1 s in or from its first chunk,
    over the echo or on a headset, with the session's default settings (no grace period)."""
    person = speech.espeak("Stop, wait a moment please.")
    voice = SpeechVoice(engines, bot_reply[1])

    async def go():
        t0 = time.monotonic()
        phone = Speakerphone(t0)
        rec = PhoneRecorder(phone)
        cfg = SessionConfig(echo_cancellation=case != "echo_without_canceller")
        s = Session(rec, voice, cfg)
        await s.start()
        await s.on_frame(P.client_text("Tell me a long story."))
        nonlocal heard_at
        person_at = None
        sent_before = 12 if case == "person_over_echo" else 0  # ~1 s of reply has been sent; its first chunk
        for k in range(0, 4 * RATE, 320):  # 4 s of microphone, in real time
            await asyncio.sleep(max(0.0, t0 + k / RATE - time.monotonic()))
            mic = phone.echo(k, 320) * 32768.0 if case != "headset_person_at_first_chunk" else np.zeros(320)
            if case.startswith(("person", "headset")):
                if person_at is None and len(rec.of("audio")) > sent_before:
                    person_at = k
                if person_at is not None:
                    mic += np.pad(person[k - person_at:k - person_at + 320], (0, 320))[:320]
            rec.mic_sent = k + 320
            await s.on_frame(P.client_audio(np.clip(mic, -32768, 32767).astype(np.int16)))
            if heard_at is None and any(m["interrupted"] for m in rec.of("response.done")):
                heard_at = k + 320  # the microphone frame that interrupted the reply (frames are handled in turn)
        await s.close()
        return rec, person_at, heard_at

    heard_at = None
    rec, person_at, heard_at = asyncio.run(go())
    interrupted = [m for m in rec.of("response.done") if m["interrupted"]]
    assert rec.of("audio")  # the reply did play
    if case == "echo":
        assert interrupted == []
    else:
        assert interrupted[:1] == [{"type": "response.done", "turn": 1, "interrupted": True}]
    if case.endswith("first_chunk"):
        # On the microphone's own clock (not wall time): VAD onset ~0.13 s + 150 ms of speech. With
        # the 0.5 s grace period and AEC3 holding the person back it was over 0.75 s.
        assert (heard_at - person_at) / RATE <= 0.5, (heard_at - person_at) / RATE


def test_turn_taking_settings_are_validated():
    for bad in ({"turn_detection": "auto"}, {"barge_in": "loud"}, {"vad_threshold": 1.5},
                {"vad_min_silence_ms": -1}, {"eot_threshold": 2}, {"eot_max_silence_ms": 100},
                {"barge_in_min_speech_ms": -5}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            SessionConfig(**bad)
    assert SessionConfig(barge_in=True).barge_in == "vad"  # the yaml's true / false, read as the modes
    assert SessionConfig(barge_in=False).barge_in == "off"


def test_person_is_heard_at_once_when_there_is_no_echo(bot_reply):
    """A headset: the reply plays, the microphone hears only the person. AEC3 alone, still learning
    an echo path that does not exist, held their speech back ~1 s; the echo check lets the raw
    audio through once the reply has been loud and the microphone silent."""
    _, reply_24k = bot_reply
    person = speech.espeak("Stop, wait a moment please.")
    mic = np.zeros(4 * RATE)
    onset = RATE
    mic[onset:onset + len(person)] += person
    for canceller in (False, True):
        started = [e.sample for e in _listen(mic, reply_24k, echo_cancellation=canceller) if e.kind == "speech.started"]
        assert started and 0 <= started[0] - onset <= 0.2 * RATE, (canceller, started)


def test_session_options_from_the_url_query():
    from pipeline.adapters.v1.options import session_options

    base = SessionConfig()
    assert session_options(base, {}) is base
    chosen = session_options(base, {"turn_detection": "manual", "echo_cancellation": "false"})
    assert chosen.turn_detection == "manual" and chosen.echo_cancellation is False
    assert base.turn_detection == "vad" and base.echo_cancellation is True  # the server's own untouched
    for bad, match in (({"turn_detection": "sometimes"}, "turn_detection"), ({"echo_cancellation": "maybe"}, "true or false"),
                       ({"max_sessions": "1000"}, "unknown session options")):
        with pytest.raises(ValueError, match=match):
            session_options(base, bad)


def test_audio_ring_keeps_the_last_samples():
    from pipeline.audio import AudioRing

    rng = np.random.default_rng(0)
    ring, stream = AudioRing(100), np.zeros(0, np.int16)
    for _ in range(300):
        x = rng.integers(-1000, 1000, int(rng.integers(0, 250))).astype(np.int16)
        ring.append(x)
        stream = np.concatenate([stream, x])
        n = int(rng.integers(0, 130))
        np.testing.assert_array_equal(ring.last(n), stream[len(stream) - min(n, 100, len(stream)):])
    assert ring.written == len(stream)


def test_push_to_talk_client_on_the_hands_free_default_gets_one_turn(engines, sentence):
    """A client written for push-to-talk sends speech with trailing silence, then turn.end. The
    server ends the turn at the pause; the turn.end that follows ends that same turn: no empty
    second turn, and the reply is not interrupted by it."""
    async def go():
        rec = Recorder()
        s = Session(rec, engines, SessionConfig(pace_lead_s=None))
        await s.start()
        await _stream(s, speech.padded(sentence, 0.3, 0.6), frame=1600)
        await s.on_frame(P.client_turn_end())
        await s.on_frame(P.client_text("And then?"))
        await rec.wait(lambda r: len(r.of("response.done")) == 2)
        await s.close()
        return rec

    rec = asyncio.run(go())
    assert [m["turn"] for m in rec.of("transcript.final")] == [1, 2]
    assert rec.of("transcript.final")[1]["text"] == "And then?"
    assert rec.of("response.done")[0]["turn"] == 1 and rec.of("audio")


# ----------------------------------------------------------------------------- preemptive generation
class Overheard:
    """The tiny engines, with two things the test must know: every LLM stream (its prompt, and
    whether it was closed before its end), and a final transcript the test chooses: what the
    recogniser's partials said, plus ``extra`` (so the final transcript equals the one at the
    pause, or not, as the test needs; the tiny recogniser's random weights may add a token at the
    end either way; the transcript the recogniser gives at a pause, ``stt_peek``, is its own)."""

    def __init__(self, inner, extra: str = ""):
        self.inner, self.extra = inner, extra
        self.partials: dict[str, str] = {}
        self.llm: list[dict] = []
        self.tts: list[dict] = []
        self.recorder: Recorder | None = None

    def __getattr__(self, name):
        return getattr(self.inner, name)

    async def stt_open(self, sid, language=None):
        self.partials[sid] = ""
        return await self.inner.stt_open(sid, language)

    async def stt_push(self, sid, pcm):
        events = await self.inner.stt_push(sid, pcm)
        self.partials[sid] = self.partials.get(sid, "") + "".join(e["text"] for e in events if e["kind"] == "partial")
        return events

    async def stt_finish(self, sid):
        _, words = await self.inner.stt_finish(sid)
        return self.partials.pop(sid, "") + self.extra, words

    def llm_stream(self, messages, **options):
        rec = {"messages": messages, "ended": False, "closed": False, "deltas": [], "started_before": None}
        self.llm.append(rec)
        if self.recorder is not None:
            rec["started_before"] = len(self.recorder.msgs)  # messages the client had been sent by then

        async def stream():
            try:
                async for delta in self.inner.llm_stream(messages, **options):
                    rec["deltas"].append(delta)
                    yield delta
                rec["ended"] = True
            finally:
                rec["closed"] = True

        return stream()

    def tts_stream(self, text, context, *voice):
        rec = {"text": text, "context": list(context), "chunks": 0, "ended": False, "closed": False,
               "by": asyncio.current_task().get_name()}  # "first-clause": made ahead (presynthesis.py)
        self.tts.append(rec)

        async def stream():
            try:
                async for chunk in self.inner.tts_stream(text, context, *voice):
                    rec["chunks"] += 1
                    yield chunk
                rec["ended"] = True
            finally:
                rec["closed"] = True

        return stream()


def _one_turn(backends, audio: np.ndarray, **cfg):
    """One hands-free turn of ``audio`` to a session with preemptive generation on, until its reply
    is done: the messages it got, and the session."""
    async def go():
        rec = Recorder()
        backends.recorder = rec
        s = Session(rec, backends, SessionConfig(pace_lead_s=None, barge_in="off", preemptive_generation=True, **cfg))
        await s.start()
        await _stream(s, audio)
        await rec.wait(lambda r: len(r.of("response.done")) == 1)
        await s.close()
        return rec, s

    return asyncio.run(go())


def test_preemptive_generation_starts_the_reply_in_the_lull_and_holds_it(engines, sentence):
    """In the lull after the sentence (preemptive_silence_ms of silence, before the VAD's
    speech.stopped) the recogniser ends a copy of the turn's stream (the transcript as it would
    end now), the LLM starts on it, and its first clause goes to the TTS, with the user's turn in
    the context, while the pause grows and Smart Turn decides. Smart Turn calls it complete: the
    turn ends with that transcript, and the reply is that LLM stream (all it wrote, once) and that
    first clause's audio (the LLM started before transcript.final went out), none of it sent
    before. (A lull mid-sentence, where espeak pauses, may start and cancel one before it.)"""
    backends = Overheard(engines)

    rec, s = _one_turn(backends, speech.padded(sentence, 0.5, 1.0))
    types = [m["type"] for m in rec.msgs]
    final, final_at = rec.of("transcript.final")[0]["text"], types.index("transcript.final")
    assert final.strip() and s.core.speculator.outcomes.get("hit") == 1 and "miss" not in s.core.speculator.outcomes
    stream = backends.llm[-1]
    assert stream["messages"][-1] == {"role": "user", "content": final.strip()} and stream["ended"]
    assert stream["started_before"] <= final_at and not any(t in ("audio", "response.text") for t in types[:final_at])
    assert all(llm["closed"] and not llm["ended"] for llm in backends.llm[:-1])  # lulls mid-sentence: cancelled
    reply = "".join(m["text"] for m in rec.of("response.text"))
    assert reply and reply == "".join(d for d in stream["deltas"] if isinstance(d, str))  # all of it, once
    spoken = [t for t in backends.tts if t["ended"]]
    assert spoken[0]["by"] == "first-clause" and reply.strip().startswith(spoken[0]["text"])  # made ahead
    assert all(t["by"] != "first-clause" for t in spoken[1:])
    assert sum(t["chunks"] for t in spoken) == len(rec.of("audio"))  # each clause made once, all of it sent
    assert all(t["closed"] for t in backends.tts)
    user = spoken[0]["context"][-1]  # the user's turn, encoded once: as the context keeps it
    kept = next(seg for seg in s.core.shared.context.segments if seg.speaker == user.speaker)
    assert user.text == final.strip() == kept.text and np.array_equal(user.codes, kept.codes)


def test_preemptive_generation_with_another_final_transcript_is_closed(engines):
    """A half sentence, then silence: Smart Turn says incomplete, the LLM has started on the
    transcript at the pause, and the turn ends at eot_max_silence_ms with a final transcript that
    differs (the test's recogniser adds a word): the speculative stream is closed unfinished and the
    reply comes from a fresh LLM call on the final prompt."""
    backends = Overheard(engines, extra=" indeed")

    rec, s = _one_turn(backends, speech.padded(speech.espeak(HALF), 0.5, 1.2), eot_max_silence_ms=800)
    assert s.core.turns.eot_probabilities[0] < 0.5  # incomplete at the pause
    final = rec.of("transcript.final")[0]["text"]
    assert final.endswith(" indeed") and s.core.speculator.outcomes.get("miss") == 1 and "hit" not in \
        s.core.speculator.outcomes
    *speculated, answered = backends.llm
    assert all(llm["closed"] and not llm["ended"] for llm in speculated)
    assert answered["messages"][-1] == {"role": "user", "content": final.strip()} and answered["ended"]


def test_preemptive_generation_is_cancelled_when_the_user_speaks_on(engines):
    """A pause mid-sentence (Smart Turn: incomplete) starts the LLM; the user speaks on: that LLM
    stream is closed unfinished, no reply audio or text goes out before the turn's end, and the
    turn gets one reply."""
    backends = Overheard(engines)
    paused = speech.with_pauses([HALF, "Paris on Friday."], pause_s=0.5)

    rec, s = _one_turn(backends, speech.padded(paused, 0.5, 1.0))
    assert s.core.turns.eot_probabilities[0] < 0.5  # the pause was judged incomplete
    assert len(rec.of("transcript.final")) == 1
    first = [m["type"] for m in rec.msgs].index("transcript.final")
    assert not any(m["type"] in ("audio", "response.text") for m in rec.msgs[:first])
    assert backends.llm[0]["closed"] and not backends.llm[0]["ended"]  # cancelled at the speech
    assert s.core.speculator.outcomes.get("cancelled", 0) >= 1 and s.core.speculator.outcomes.get("hit") == 1


# ----------------------------------------------------------------------------- false interruptions
def Says(engines, text: str) -> Oracle:
    """The tiny engines, hearing what the test says was said: a turn's partial transcript, once
    0.5 s of its audio is in, and its final transcript are ``text`` (the tiny recogniser's random
    weights cannot recognise "mm-hm"); every TTS chunk made is kept (load/backchannels.py)."""
    return Oracle(engines, text, RATE // 2, final_from=0)


@pytest.mark.parametrize("said", ["Mm-hm.", "Stop, tell me about the trains."])
def test_a_backchannel_pauses_and_resumes_the_reply_a_turn_ends_it(engines, said):
    """With resume_false_interruption, a person saying "mm-hm" over the reply (espeak, a headset)
    pauses it and it resumes where it paused: every sample the TTS made is sent once, in order,
    and no turn is taken. Words that are not a backchannel end it as a barge-in does."""
    backends = Says(engines, said)
    person = speech.espeak("Mm-hm." if said == "Mm-hm." else said)

    async def go():
        t0 = time.monotonic()
        rec = Recorder()
        s = Session(rec, backends, SessionConfig(resume_false_interruption=True))
        await s.start()
        await s.on_frame(P.client_text("Tell me a long story."))
        person_at = None
        for k in range(0, 12 * RATE, 320):  # up to 12 s of microphone, in real time
            await asyncio.sleep(max(0.0, t0 + k / RATE - time.monotonic()))
            mic = np.zeros(320, np.float32)
            if person_at is None and len(rec.of("audio")) > 12:  # ~1 s of reply has been sent
                person_at = k
            if person_at is not None:
                mic += np.pad(person[k - person_at:k - person_at + 320], (0, 320))[:320]
            await s.on_frame(P.client_audio(np.clip(mic, -32768, 32767).astype(np.int16)))
            if rec.of("response.done") and (said == "Mm-hm." or rec.of("transcript.final")[1:]):
                break
        await rec.wait(lambda r: len(r.of("response.done")) >= (1 if said == "Mm-hm." else 2))
        await s.close()
        return rec

    rec = asyncio.run(go())
    kinds = [m["type"] for m in rec.msgs]
    assert "response.paused" in kinds, kinds
    first = [m for m in rec.of("response.done") if m["turn"] == 1]
    if said == "Mm-hm.":
        assert kinds.index("response.paused") < kinds.index("response.resumed") < kinds.index("response.done")
        assert first[0]["interrupted"] is False
        assert [m["turn"] for m in rec.of("transcript.final")] == [1]  # the backchannel took no turn
        sent = [m for m in rec.of("audio") if m["turn"] == 1]
        assert [m["seq"] for m in sent] == list(range(len(sent)))
        played = np.concatenate([np.frombuffer(m["pcm"], "<i2") for m in sent])
        np.testing.assert_array_equal(played, np.concatenate(backends.made))  # none skipped, none repeated
    else:
        assert "response.resumed" not in kinds
        assert first[0]["interrupted"] is True
        assert [m["turn"] for m in rec.of("transcript.final")] == [1, 2]
        assert "transcript.partial" in kinds, [k for k in kinds if k not in ("audio", "response.text")]
        assert kinds.index("response.done") < kinds.index("transcript.partial")


def test_a_short_backchannel_resumes_the_reply_as_its_speech_stops(engines):
    """backchannel_max_ms: "mm-hm" over a reply paused by it ends its turn at the VAD's
    speech.stopped, so the reply resumes in that very microphone frame. Without the rule it waited
    on Smart Turn, which doubts a lone "mm-hm" at first (the reply resumed frames later); the
    backchannel still takes no turn, and nothing of the reply is skipped."""
    backends = Says(engines, "Mm-hm.")
    person = speech.espeak("Mm-hm.")

    async def go():
        t0 = time.monotonic()
        rec = Recorder()
        s = Session(rec, backends, SessionConfig(resume_false_interruption=True, backchannel_max_ms=800))
        await s.start()
        await s.on_frame(P.client_text("Tell me a long story."))
        person_at, frame_of = None, {}
        for k in range(0, 8 * RATE, 320):
            await asyncio.sleep(max(0.0, t0 + k / RATE - time.monotonic()))
            mic = np.zeros(320, np.float32)
            if person_at is None and len(rec.of("audio")) > 12:
                person_at = k
            if person_at is not None:
                mic += np.pad(person[k - person_at:k - person_at + 320], (0, 320))[:320]
            await s.on_frame(P.client_audio(np.clip(mic, -32768, 32767).astype(np.int16)))
            for kind in ("speech.stopped", "response.resumed"):
                if rec.of(kind) and kind not in frame_of:
                    frame_of[kind] = k
            if "response.resumed" in frame_of:
                break
        await s.close()
        return rec, frame_of

    rec, frame_of = asyncio.run(go())
    assert frame_of.get("response.resumed") is not None and frame_of["response.resumed"] == frame_of["speech.stopped"]
    assert [m["turn"] for m in rec.of("transcript.final")] == [1]  # the backchannel took no turn
    sent = [m for m in rec.of("audio") if m["turn"] == 1]
    played = np.concatenate([np.frombuffer(m["pcm"], "<i2") for m in sent])
    np.testing.assert_array_equal(played, np.concatenate(backends.made)[:len(played)])
