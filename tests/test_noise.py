"""Hearing through noise, in-process on short generated clips: the session's ears (echo canceller,
noise suppressor, Silero VAD) over espeak speech, a reply's echo and noise made in code
(load/noises.py); the suppressors with their real libraries and weights; and the Realtime
session's ``noise_reduction`` applied to the core. The same ears over minutes of each noise, before
and after: ``python -m load.noisy`` (docs/measurements/turn-taking.md)."""
from __future__ import annotations

import asyncio

import numpy as np
import pytest

from load import noises, speech
from load.noisy import Reply
from pipeline.audio import float_to_int16, int16_to_float
from pipeline.audio_constants import REPLY_RATE, USER_RATE
from pipeline.conversation.ears import suppression
from pipeline.conversation.ears.echo import EchoCanceller
from pipeline.conversation.ears.listening import Listener
from pipeline.session_config import SessionConfig

pytestmark = pytest.mark.skipif(not speech.available(), reason="needs espeak-ng (scripts/install.sh --system)")
FRAME = USER_RATE // 50
SPEECH_RMS = 10 ** (-18 / 20)  # the bench's spoken sentences, about -18 dBFS


def _rms_db(x: np.ndarray) -> float:
    return 20 * np.log10(max(1e-9, float(np.sqrt(np.mean(np.square(x.astype(np.float64)))))))


def _through(kind: str, pcm: np.ndarray) -> np.ndarray:
    s = suppression.suppressor(kind)
    out = np.concatenate([s.process(pcm[i:i + FRAME]) for i in range(0, len(pcm), FRAME)])
    return np.pad(out, (0, len(pcm) - len(out)))


@pytest.mark.parametrize("kind", suppression.KINDS)
def test_each_suppressors_delay_is_the_one_the_ears_drop(kind):
    """The output lags the input by exactly DELAYS[kind] samples (measured on synthetic speech by
    cross-correlation), so the samples the ears hand on are the microphone's, position for position."""
    assert suppression.measured_delay(kind) == suppression.DELAYS[kind]


@pytest.mark.parametrize("kind", suppression.KINDS)
def test_each_suppressor_takes_steady_noise_down_and_lets_speech_through(kind):
    """2 s of pink noise alone comes out at least 6 dB quieter (after the first 0.5 s, while the
    suppressor learns it); a spoken sentence (espeak) within 3 dB of what went in."""
    pink = float_to_int16(noises.at_snr(noises.noise("pink", 2.0, seed=3), SPEECH_RMS, 0.0))
    voice = speech.espeak("Could you book a table for two at seven tonight?")
    steady = slice(USER_RATE // 2, None)
    assert _rms_db(_through(kind, pink)[steady]) <= _rms_db(pink[steady]) - 6
    assert abs(_rms_db(_through(kind, voice)) - _rms_db(voice)) <= 3


def test_an_unknown_suppressor_is_refused_by_name():
    with pytest.raises(ValueError, match="noise_reduction"):
        SessionConfig(noise_reduction="krisp")
    with pytest.raises(ValueError, match="unknown noise suppressor"):
        suppression.suppressor("krisp")


def _echo_and_noise(kind: str, snr_db: float, seconds: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """A reply playing on a speakerphone (its echo at -10 dB, 150 ms late) under ``kind`` noise:
    (the microphone, int16 16 kHz; the reply as sent, int16 24 kHz)."""
    n = int(seconds * USER_RATE)
    echo, reply_24k = Reply().over(n)
    noise = noises.at_snr(noises.noise(kind, seconds, seed), SPEECH_RMS, snr_db)
    return float_to_int16(np.clip(echo + noise, -1, 1)), reply_24k


def test_under_steady_noise_the_canceller_waits_for_the_echo_it_half_hears():
    """Pink noise at 10 dB under a reply's echo: the echo correlates with the reply only ~0.5 (the
    noise dilutes it), short of certain, so it takes a whole second of the same delay to be sure.
    Meanwhile the canceller must not decide "no echo" (and hand the VAD the raw audio, echo and
    all) just because 0.5 s of loud reply went by: the cancelled audio is judged throughout."""
    mic, reply_24k = _echo_and_noise("pink", 10.0, 1.5, seed=8)
    canceller, per_frame, judged_raw = EchoCanceller(), REPLY_RATE // 50, []
    for k, i in enumerate(range(0, len(mic) - FRAME + 1, FRAME)):
        canceller.reference(reply_24k[k * per_frame:(k + 1) * per_frame])
        canceller.process(mic[i:i + FRAME])
        if i >= USER_RATE // 2:  # by now the first check has seen the echo-like peak
            judged_raw.append(not canceller.use_cancelled)
    assert not any(judged_raw)
    assert canceller.echo_heard  # it was sure in the end


def _barge_ins(mic: np.ndarray, reply_24k: np.ndarray, cfg: SessionConfig, speech_from: int | None = None) -> list[int]:
    """Where a barge-in would have cut the reply (samples), by the session's ears and rule."""
    ears, per_frame, at, armed = Listener(cfg.vad_settings, True, noise_reduction=cfg.noise_reduction), REPLY_RATE // 50, [], True
    for k, i in enumerate(range(0, len(mic) - FRAME + 1, FRAME)):
        ears.reference(reply_24k[k * per_frame:(k + 1) * per_frame])
        ears.hear(mic[i:i + FRAME])
        if armed and ears.vad.speech_ms >= cfg.barge_in_min_speech_ms:
            at.append(i + FRAME)
            armed = False
        elif ears.vad.speech_ms == 0 and not ears.speaking:
            armed = True
    return at


@pytest.mark.parametrize("noise_reduction", [None, "rnnoise"])
def test_noise_bursts_over_a_reply_do_not_cut_it_and_stop_does(noise_reduction):
    """6 s of a door, coughs and keyboard clicks at 5 dB SNR over a playing reply cut nothing; then
    "Stop." said over the same reply and bursts cuts it, within 400 ms of its first sound (the VAD's
    64 ms of speech after its onset windows, and the suppressor's delay)."""
    cfg = SessionConfig(noise_reduction=noise_reduction)
    noisy, reply_24k = _echo_and_noise("bursts", 5.0, 8.0, seed=11)
    stop, lead = int16_to_float(speech.espeak("Stop.")), 6 * USER_RATE
    said = int16_to_float(noisy)
    said[lead:lead + len(stop)] += stop
    at = _barge_ins(float_to_int16(np.clip(said, -1, 1)), reply_24k, cfg)
    assert len(at) == 1 and lead < at[0] <= lead + 0.4 * USER_RATE, at


def test_a_suppressor_changed_mid_stream_keeps_the_vads_positions_the_microphones():
    """A session that turns the suppressor on mid-stream, then changes it: the speech onset the
    VAD reports is where it is in the microphone stream (within the VAD's own 32 ms window), as
    with no suppressor at all."""
    clip = speech.espeak("Could you book a table for two?")
    pcm = np.concatenate([np.zeros(2 * USER_RATE, np.int16), clip, np.zeros(USER_RATE, np.int16)])

    def onset(switches: dict[int, str | None]) -> int:
        ears = Listener(SessionConfig().vad_settings, echo_cancellation=False)
        for i in range(0, len(pcm), FRAME):
            if i in switches:
                ears.suppress(switches[i])
                ears._coming.result() if ears._coming else None  # made: taken at the next frame
            for ev in ears.hear(pcm[i:i + FRAME]):
                if ev.kind == "speech.started":
                    return ev.sample
        raise AssertionError("no speech heard")

    plain = onset({})
    assert abs(onset({FRAME * 10: "deepfilter", FRAME * 60: "webrtc"}) - plain) <= 512
    assert abs(onset({FRAME * 10: "webrtc", FRAME * 60: "deepfilter"}) - plain) <= 512


def test_realtime_noise_reduction_is_answered_and_applied_to_the_sessions_ears():
    """session.update's audio.input.noise_reduction: near_field puts RNNoise in the session's ears,
    far_field DeepFilterNet3, null none; the session object says what was set; a type that does
    not exist is refused naming the field, and changes nothing."""
    from tests.test_realtime import Wire, send
    from pipeline.adapters.realtime.adapter import RealtimeSession
    from tests.test_conversation import Engines

    async def go():
        wire = Wire()
        s = RealtimeSession(wire, Engines(["Hello."]), SessionConfig())
        await s.start()
        seen = {}
        for value in ({"type": "near_field"}, {"type": "far_field"}, None, {"type": "studio"}):
            await send(s, type="session.update", session={"audio": {"input": {"noise_reduction": value}}})
            ears = s.core.turns.ears
            if ears._coming is not None:
                ears._coming.result()
            ears.hear(np.zeros(FRAME, np.int16))  # the next frame takes the one made
            seen[str(value)] = (s.core.shared.cfg.noise_reduction, getattr(ears.suppressor, "kind", None))
        await s.close()
        return wire, seen

    wire, seen = asyncio.run(go())
    assert seen == {"{'type': 'near_field'}": ("rnnoise", "rnnoise"), "{'type': 'far_field'}": ("deepfilter", "deepfilter"),
                    "None": (None, None), "{'type': 'studio'}": (None, None)}
    assert [u["session"]["audio"]["input"]["noise_reduction"] for u in wire.of("session.updated")] == [
        {"type": "near_field"}, {"type": "far_field"}, None]
    assert wire.of("error")[-1]["error"]["param"] == "session.audio.input.noise_reduction"


def test_v1_and_phone_sessions_choose_their_suppressor_and_a_bad_one_is_refused():
    """v1's ``noise_reduction`` session option and a phone agent's ``noise_reduction``: a
    suppressor by name, ``none`` for none, anything else a clear error."""
    from pipeline.adapters.phone.config import PhoneAgent
    from pipeline.adapters.v1.options import session_options

    server = SessionConfig(noise_reduction="webrtc")
    assert session_options(server, {"noise_reduction": "deepfilter"}).noise_reduction == "deepfilter"
    assert session_options(server, {"noise_reduction": "none"}).noise_reduction is None
    assert session_options(server, {}).noise_reduction == "webrtc"
    with pytest.raises(ValueError, match="noise_reduction must be one of"):
        session_options(server, {"noise_reduction": "loud"})
    assert PhoneAgent(noise_reduction="rnnoise").turn_taking_changes() == {"noise_reduction": "rnnoise"}
    assert PhoneAgent(noise_reduction="none").turn_taking_changes() == {"noise_reduction": None}
    assert PhoneAgent().turn_taking_changes() == {}
    with pytest.raises(ValueError, match="noise_reduction"):
        PhoneAgent(noise_reduction="loud")


def _vad_events(pcm: np.ndarray, foreground_db: float) -> list[tuple[str, int]]:
    from pipeline.conversation.ears.vad import VoiceActivity

    vad = VoiceActivity(SessionConfig(vad_foreground_db=foreground_db).vad_settings)
    return [(ev.kind, ev.sample) for i in range(0, len(pcm), FRAME) for ev in vad.push(pcm[i:i + FRAME])]


def _under(kind: str, snr_db: float, text: str, seed: int) -> tuple[np.ndarray, int]:
    """``text`` said 1.5 s into ``kind`` noise, which goes on 2.5 s after it: (the audio, where the speech ends)."""
    clip = int16_to_float(speech.espeak(text))
    lead, tail = int(1.5 * USER_RATE), int(2.5 * USER_RATE)
    voice = np.concatenate([np.zeros(lead), clip, np.zeros(tail)]).astype(np.float32)
    level = noises.speech_rms(speech.espeak(text))
    noise = noises.at_snr(noises.noise(kind, len(voice) / USER_RATE, seed), level, snr_db)
    return float_to_int16(np.clip(voice + noise, -1, 1)), lead + len(clip)


@pytest.mark.parametrize("kind", ["babble", "tv"])
def test_under_background_voices_the_speech_stops_when_the_caller_does(kind):
    """A sentence said over babble (six voices) or a television's voice at 10 dB SNR: Silero hears
    the room as speech, so without the foreground rule (vad_foreground_db 0) the VAD never stops
    after the caller does (2.5 s of the room follow); with it, it stops within 2 s of the caller's
    last sound (the bench's 14 sentences: 0.3 s median, 0.8 s p90 over babble)."""
    pcm, end = _under(kind, 10.0, "I would like to book a flight to Paris on Friday.", seed=21)
    assert not [s for k, s in _vad_events(pcm, 0.0) if k == "speech.stopped" and s >= end - USER_RATE // 4]
    stops = [s for k, s in _vad_events(pcm, 10.0) if k == "speech.stopped" and s >= end - USER_RATE // 4]
    assert stops and stops[0] <= end + 2 * USER_RATE, (stops, end)


@pytest.mark.parametrize("kind", [None, "pink", "brown"])
def test_in_quiet_the_foreground_rule_changes_nothing_and_under_steady_noise_no_onset(kind):
    """Where the room is quiet the VAD's events are the same with the foreground rule as without
    it, sample for sample; under steady noise (not voice) at 10 dB every speech onset is (a
    barge-in is as fast), though it may place a stop inside a sentence at a quiet syllable
    (Smart Turn judges those pauses: the bench's turns ended mid-sentence did not rise)."""
    for seed, text in enumerate(["Could you book a table for two?", "Well, I think so, but let me check first."]):
        if kind is None:
            clip = speech.espeak(text)
            pcm = np.concatenate([np.zeros(USER_RATE, np.int16), clip, np.zeros(2 * USER_RATE, np.int16)])
            assert _vad_events(pcm, 10.0) == _vad_events(pcm, 0.0)
            continue
        pcm, _ = _under(kind, 10.0, text, seed=30 + seed)
        onsets = [[s for k, s in _vad_events(pcm, db) if k == "speech.started"] for db in (10.0, 0.0)]
        assert onsets[0][0] == onsets[1][0]


def test_while_a_reply_plays_the_foreground_rule_does_not_act():
    """A television's voice alone at 10 dB under a playing reply: barge-ins are where they are
    without the rule, sample for sample. (Acting there, with no caller heard yet, it took the
    television for the caller and each of its sentences for a new barge-in.)"""
    mic, reply_24k = _echo_and_noise("tv", 10.0, 20.0, seed=41)
    with_rule = _barge_ins(mic, reply_24k, SessionConfig(vad_foreground_db=10.0))
    assert with_rule == _barge_ins(mic, reply_24k, SessionConfig(vad_foreground_db=0.0))
