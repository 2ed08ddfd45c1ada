"""Phone calls over the conversation core (pipeline/adapters/phone/adapter.py), in-process with the tiny
engines: a test carrier speaks Twilio's (and Telnyx's) exact messages, written here from their
documentation and cross-checked with Pipecat's TwilioFrameSerializer, not with our own code.

What the caller heard is known from the marks the carrier echoes: a reply cut after k marks keeps
exactly the text whose audio began before the k-th mark, counted from the media bytes the carrier
received before it.
"""
from __future__ import annotations

import asyncio
import audioop
import base64
import json
import time
from types import SimpleNamespace

import numpy as np
from scipy.signal import resample_poly

import pytest

from load.phone import Phone
from pipeline.adapters.phone.adapter import serve_call
from pipeline.adapters.phone.call_control import TelnyxCalls, TwilioCalls
from pipeline.connection import SessionRegistry
from pipeline.conversation.observer import Observer
from pipeline.adapters.phone.config import read_phone_section
from pipeline.session_config import SessionConfig
from tests.fake_carrier_api import FakeCarrierAPI
from tests.test_session import _fresh, engines  # noqa: F401 - the module's tiny engines (a slow LLM)

STREAM, CALL = "MZ00000000000000000000000000000001", "CA00000000000000000000000000000001"


class Carrier:
    """A carrier's side of one media stream, as the test drives it: messages to send queued in
    ``inbox``, what the server sends kept in ``sent``; marks are echoed when ``echo`` says."""

    def __init__(self, provider: str = "twilio", echo_marks: bool = True, play: bool = False):
        self.provider = provider
        self.inbox: asyncio.Queue = asyncio.Queue()
        self.sent: list[dict] = []
        self.echo_marks = echo_marks
        self.play = play  # echo each mark when the audio before it has played out at real time
        self.played_out_at = 0.0  # (time.monotonic) when the audio queued so far ends
        self.echoed_at: list[float] = []
        self.played: list[list] = []  # (play=True) [starts, ends, μ-law bytes] of each media frame, cut by clear
        self._timers: dict[str, asyncio.TimerHandle] = {}
        self.frames_at_clear = 0  # media frames sent before the last clear
        self.close_code: int | None = None
        self.close_reason = ""
        self.closed = asyncio.Event()
        self._arrived = asyncio.Condition()

    # the Connection the server serves
    async def receive(self):
        return await self.inbox.get()

    async def send(self, frame: str) -> None:
        msg = json.loads(frame)
        self.sent.append(msg)
        now = time.monotonic()
        if msg["event"] == "media" and self.play:
            data = base64.b64decode(msg["media"]["payload"])
            start = max(self.played_out_at, now)
            self.played_out_at = start + len(data) / 8000
            self.played.append([start, self.played_out_at, data])
        elif msg["event"] == "mark" and self.play:
            name = msg["mark"]["name"]
            self._timers[name] = asyncio.get_running_loop().call_later(max(0.0, self.played_out_at - now),
                                                                       self._echo_now, name)
        elif msg["event"] == "clear" and self.play:  # as Twilio: the queue dropped, its marks echoed at once
            self.played = [[a, min(b, now), d[:max(0, int((min(b, now) - a) * 8000))]] for a, b, d in self.played
                           if a < now]
            self.played_out_at, self.frames_at_clear = now, len(self.played)
            for name, timer in list(self._timers.items()):
                timer.cancel()
                self._echo_now(name)
        elif msg["event"] == "mark" and self.echo_marks:
            self.inbox.put_nowait(json.dumps(self._echo(msg["mark"]["name"])))
        async with self._arrived:
            self._arrived.notify_all()

    def _echo_now(self, name: str) -> None:
        self._timers.pop(name, None)
        self.echoed_at.append(time.monotonic())
        self.inbox.put_nowait(json.dumps(self._echo(name)))

    async def close(self, code: int, reason: str) -> None:
        self.close_code, self.close_reason = code, reason
        self.closed.set()

    async def wait(self, pred, timeout=60):
        async with self._arrived:
            await asyncio.wait_for(self._arrived.wait_for(lambda: pred(self.sent)), timeout)

    # Twilio's messages (twilio.com/docs/voice/media-streams/websocket-messages) and Telnyx's
    def connected(self) -> None:
        msg = {"event": "connected", "protocol": "Call", "version": "1.0.0"} if self.provider == "twilio" else \
            {"event": "connected", "version": "1.0.0"}
        self.inbox.put_nowait(json.dumps(msg))

    def start(self, encoding: str | None = None, parameters: dict | None = None) -> None:
        if self.provider == "twilio":
            msg = {"event": "start", "sequenceNumber": "1", "streamSid": STREAM, "start": {
                "accountSid": "AC0", "streamSid": STREAM, "callSid": CALL, "tracks": ["inbound"],
                "customParameters": parameters or {},
                "mediaFormat": {"encoding": encoding or "audio/x-mulaw", "sampleRate": 8000, "channels": 1}}}
        else:
            msg = {"event": "start", "sequence_number": "1", "stream_id": STREAM, "start": {
                "user_id": "u0", "call_control_id": CALL, "client_state": None,
                "custom_parameters": [{"name": k, "value": v} for k, v in (parameters or {}).items()],
                "media_format": {"encoding": encoding or "PCMA", "sample_rate": 8000, "channels": 1}}}
        self.inbox.put_nowait(json.dumps(msg))

    def media(self, payload: bytes) -> None:
        key = "streamSid" if self.provider == "twilio" else "stream_id"
        self.inbox.put_nowait(json.dumps({"event": "media", "sequenceNumber": "2", key: STREAM, "media": {
            "track": "inbound", "chunk": "1", "timestamp": "20", "payload": base64.b64encode(payload).decode()}}))

    def dtmf(self, digit: str) -> None:
        key = "streamSid" if self.provider == "twilio" else "stream_id"
        self.inbox.put_nowait(json.dumps({"event": "dtmf", key: STREAM, "sequenceNumber": "3",
                                          "dtmf": {"track": "inbound_track", "digit": digit}}))

    def _echo(self, name: str) -> dict:
        key = "streamSid" if self.provider == "twilio" else "stream_id"
        return {"event": "mark", "sequenceNumber": "4", key: STREAM, "mark": {"name": name}}

    def stop(self) -> None:
        self.inbox.put_nowait(json.dumps({"event": "stop", "sequenceNumber": "5", "streamSid": STREAM,
                                          "stop": {"accountSid": "AC0", "callSid": CALL}}))

    def of(self, event: str) -> list[dict]:
        return [m for m in self.sent if m["event"] == event]


def _ulaw(pcm16k: np.ndarray) -> bytes:
    """16 kHz int16 -> 8 kHz μ-law, with scipy and the standard library (not our resampler)."""
    pcm8k = np.clip(resample_poly(pcm16k.astype(np.float64), 1, 2), -32768, 32767).astype("<i2")
    return audioop.lin2ulaw(pcm8k.tobytes(), 2)


def _cfg(**settings) -> SessionConfig:
    return SessionConfig(**{"pace_lead_s": 0.1, "vad_events": False, **settings})


class Registry(SessionRegistry):
    """The sessions of a test's calls, kept after they end (``opened``)."""

    def __init__(self):
        super().__init__(4)
        self.opened = []
        self.added = asyncio.Event()

    def add(self, session) -> None:
        super().add(session)
        self.opened.append(session)
        self.added.set()

    async def first(self):
        await asyncio.wait_for(self.added.wait(), 30)
        return self.opened[0]


async def _until(session, predicate, timeout: float = 30) -> None:
    """Wait until ``predicate()`` holds, looking again at each change of the conversation's state."""
    changed = session.core.changed
    async with asyncio.timeout(timeout):
        while True:
            changed.clear()
            if predicate():
                return
            await changed.wait()


async def _call(backends, carrier: Carrier, verify=None, cfg: SessionConfig | None = None, door=None,
                start_within_s: float = 5.0, **phone):
    """The call served as the gateway serves it (``serve_call``: its start first, then the session)."""
    registry = Registry()
    served = asyncio.create_task(serve_call(carrier, backends, cfg or _cfg(), registry, carrier.provider, verify,
                                            door, start_within_s, **phone))
    return served, registry


class Errors(Observer):
    """An observer that keeps the error codes counted."""

    def __init__(self):
        self.codes: list[str] = []

    def error(self, code: str) -> None:
        self.codes.append(code)


def _calls(provider: str, api: FakeCarrierAPI):
    """The carrier's official client (through pipeline.adapters.phone.call_control) against the local fake."""
    return TwilioCalls("AC0", "token", api.url) if provider == "twilio" else TelnyxCalls("KEY0", api.url + "/v2")


AGENTS = read_phone_section({"agents": {
    "hangs_up": {"speaks_first": True, "tools": ["end_call"], "tool_choice": {"type": "function", "name": "end_call"}},
    "transfers": {"speaks_first": True, "tools": ["transfer_call"], "transfer_to": ["+15550001111"],
                  "tool_choice": {"type": "function", "name": "transfer_call"}},
    "collects": {"speaks_first": True, "tools": ["collect_digits"], "dtmf": "tool",
                 "tool_choice": {"type": "function", "name": "collect_digits"}},
    "plain": {"instructions": "You answer the phone for a bakery."},
}})


async def _agent_call(backends, provider: str, agent: str, api: FakeCarrierAPI, before=None, observer=None,
                      **parameters):
    """A call whose start names ``agent``; runs until the stream closes (30 s at most)."""
    carrier = Carrier(provider)
    carrier.connected()
    carrier.start(encoding="PCMU" if provider == "telnyx" else None, parameters={"agent": agent, **parameters})
    if before is not None:
        before(carrier)
    # A forced call is one item, after all its tokens: the slow test LLM (20 ms a token) needs more
    # than the default 1.5 s for a transfer's arguments.
    served, registry = await _call(backends, carrier, cfg=_cfg(engine_timeout_s=5.0), phone=AGENTS,
                                   calls=_calls(provider, api), observer=observer)
    await asyncio.wait_for(served, 30)
    return carrier, (registry.opened or [None])[0]


def test_a_call_answers_keys_and_a_cut_reply_keeps_what_the_caller_heard(engines):  # noqa: F811
    """A key press is a turn; its reply streams as 20 ms μ-law frames, each chunk followed by a mark.
    The carrier echoes the first two marks only; a second key press cuts the reply: `clear` goes out,
    and the history keeps exactly the clauses whose audio had begun by the second echoed mark."""
    backends = _fresh(engines)

    async def go():
        carrier = Carrier(echo_marks=False)
        carrier.connected()
        carrier.start()
        served, registry = await _call(backends, carrier)
        carrier.dtmf("1")
        await carrier.wait(lambda sent: len([m for m in sent if m["event"] == "mark"]) >= 3)
        marks = carrier.of("mark")
        heard_bytes = sum(len(base64.b64decode(m["media"]["payload"]))
                          for m in carrier.sent[:carrier.sent.index(marks[1])] if m["event"] == "media")
        for mark in marks[:2]:
            carrier.inbox.put_nowait(json.dumps(carrier._echo(mark["mark"]["name"])))
        session = next(iter(registry))
        reply = session.core.replies.reply
        await carrier.wait(lambda sent: len(reply.spoken) >= 2)  # a second clause went out, unheard
        carrier.dtmf("2")  # after the echoes: frames are handled in order
        await carrier.wait(lambda sent: any(m["event"] == "clear" for m in sent))
        carrier.stop()
        await asyncio.wait_for(served, 30)
        return carrier, session.core.shared.history.messages(), reply, heard_bytes

    carrier, history, reply, heard_bytes = asyncio.run(go())
    media = carrier.of("media")
    assert media and all(len(base64.b64decode(m["media"]["payload"])) == 160 and m["streamSid"] == STREAM
                         for m in media)
    assert history[0] == {"role": "user", "content": "(The caller pressed 1 on the keypad.)"}
    heard_samples = heard_bytes * 3  # 8 kHz μ-law bytes -> 24 kHz samples
    expected = " ".join(clause for start, clause in reply.spoken if start < heard_samples)
    assert history[1]["role"] == "assistant" and history[1]["content"] == expected
    assert reply.said.startswith(expected) and reply.said != expected  # sent more than was heard
    assert history[2]["content"] == "(The caller pressed 2 on the keypad.)"
    assert carrier.close_code == 1000


class Made:
    """The tiny engines, keeping every chunk of audio the TTS made."""

    def __init__(self, inner):
        self.inner, self.made = inner, []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    async def tts_stream(self, text, context, *voice):
        async for pcm, codes in self.inner.tts_stream(text, context, *voice):
            self.made.append(np.array(pcm))
            yield pcm, codes


def test_a_paused_reply_resumes_on_the_phone_with_nothing_skipped_or_said_twice(engines):  # noqa: F811
    """resume_false_interruption on a call: speech over the reply pauses it. The carrier cannot
    pause: it is cleared, and when the speech proves no turn, what the caller had not heard is sent
    again first. The phone, playing in real time, plays the whole reply once: as long as it (within
    60 ms: where the phone had got to is reckoned from its marks' echoes), and the same audio. With
    nothing sent again, 0.3-0.6 s (what the carrier held: pace_lead_s 0.5) went missing."""
    backends = Made(_fresh(engines))

    async def go():
        carrier = Carrier(play=True)
        carrier.connected()
        carrier.start()
        served, registry = await _call(backends, carrier, cfg=_cfg(resume_false_interruption=True, pace_lead_s=0.5))
        carrier.dtmf("1")
        await carrier.wait(lambda sent: len(carrier.echoed_at) >= 4)  # the phone plays it
        session = next(iter(registry))
        replies = session.core.replies
        await replies.barge_in("")  # what speech over it does: pauses it (a backchannel so far)
        assert replies.paused and carrier.of("clear")
        await asyncio.sleep(0.3)  # the pause the caller hears (not a synchronisation)
        await replies.resume()  # the speech was no turn
        await _until(session, lambda: not replies.running)
        await asyncio.sleep(max(0.0, carrier.played_out_at - time.monotonic()))  # the phone's own clock
        carrier.stop()
        await asyncio.wait_for(served, 30)
        return carrier

    carrier = asyncio.run(go())
    heard = np.frombuffer(audioop.ulaw2lin(b"".join(d for _, _, d in carrier.played), 2), "<i2").astype(np.float64)
    made = resample_poly(np.concatenate(backends.made).astype(np.float64), 1, 3)
    assert abs(len(heard) - len(made)) <= 0.06 * 8000, (len(heard), len(made))
    before = sum(len(d) for _, _, d in carrier.played[:carrier.frames_at_clear])  # heard before the pause
    assert error(heard[:before], made[:before]) < 0.1 and error(heard[before:], made[-(len(heard) - before):]) < 0.1


def test_a_pause_never_lands_inside_a_chunks_frames(engines):  # noqa: F811
    """A carrier whose every send yields to the loop: a reply chunk of 200 ms (ten frames) is being
    sent when speech pauses the reply. The clear goes out after the chunk's last frame and its mark,
    so the audio held for the resume is all the carrier dropped, in order."""
    from types import SimpleNamespace

    from pipeline.conversation import events as E

    class Yielding(Carrier):
        async def send(self, frame: str) -> None:
            await asyncio.sleep(0)
            await super().send(frame)

    async def go():
        carrier = Yielding(echo_marks=False)
        carrier.connected()
        carrier.start()
        served, registry = await _call(_fresh(engines), carrier, cfg=_cfg(resume_false_interruption=True))
        await carrier.wait(lambda sent: registry.opened)
        session = next(iter(registry))
        reply = SimpleNamespace(id="resp_1", item_id="item_1", samples=0)
        pcm = (3000 * np.sin(np.arange(4800) / 5)).astype(np.int16)
        await asyncio.gather(session.emit(E.ReplyAudio(reply, pcm, 0)), session.emit(E.ReplyPaused(reply)))
        carrier.stop()
        await asyncio.wait_for(served, 30)
        return carrier, session

    carrier, session = asyncio.run(go())
    kinds = [m["event"] for m in carrier.sent]
    assert kinds.count("media") >= 9 and kinds.index("clear") > kinds.index("mark") > max(
        i for i, k in enumerate(kinds) if k == "media")


def test_bad_streams_are_closed_with_a_reason_and_another_call_goes_on(engines):  # noqa: F811
    backends = _fresh(engines)
    bad = {
        "media before start": lambda c: c.media(b"\xff" * 160),
        "a wrong codec": lambda c: c.start(encoding="audio/x-l16"),
        "non-base64 media": lambda c: (c.start(), c.inbox.put_nowait(json.dumps(
            {"event": "media", "streamSid": STREAM, "media": {"payload": "not base64!"}}))),
        "an oversized message": lambda c: (c.start(), c.inbox.put_nowait("x" * 70_000)),
        "a refused credential": lambda c: c.start(parameters={"ticket": "forged"}),
    }

    async def go():
        good = Carrier()
        good.connected()
        good.start(parameters={"ticket": "good"})
        verify = _verifier({"good"})
        good_call, _ = await _call(backends, good, verify)
        closed = {}
        for name, send in bad.items():
            carrier = Carrier()
            send(carrier)
            served, _ = await _call(backends, carrier, verify)
            await asyncio.wait_for(served, 30)
            closed[name] = (carrier.close_code, carrier.close_reason)
        good.dtmf("5")
        await good.wait(lambda sent: any(m["event"] == "media" for m in sent))
        good.stop()
        await asyncio.wait_for(good_call, 30)
        return closed, good

    closed, good = asyncio.run(go())
    assert {name: code for name, (code, _) in closed.items()} == {name: 1008 for name in bad}
    assert "before start" in closed["media before start"][1] and "audio/x-mulaw" in closed["a wrong codec"][1]
    assert closed["a refused credential"][1] == "unauthorized"
    assert good.close_code == 1000 and good.of("media")


def _verifier(good: set[str]):
    async def verify(credential):
        return credential in good
    return verify


def test_telnyx_streams_pcma_both_ways(engines):  # noqa: F811
    """A-law, both ways, against a reference tone: the caller's A-law tone reaches the conversation
    as that tone at 16 kHz; the reply's audio (a tone from the TTS) reaches the carrier as A-law of
    it. Read as μ-law, the same bytes are not that tone: the codec is A-law, not any G.711."""
    from tests.test_realtime import TTSSpy

    spy = TTSSpy(_fresh(engines), tone=True)
    tone16k = (8000 * np.sin(2 * np.pi * 440 * np.arange(16_000) / 16_000)).astype(np.int16)
    pcm8k = np.clip(resample_poly(tone16k.astype(np.float64), 1, 2), -32768, 32767).astype("<i2")
    alaw_in = audioop.lin2alaw(pcm8k.tobytes(), 2)
    heard: list[np.ndarray] = []

    async def go():
        carrier = Carrier("telnyx")
        carrier.connected()
        carrier.start(encoding="PCMA")
        served, registry = await _call(spy, carrier)
        session = await registry.first()
        do = session.core.do

        async def record(command):
            if type(command).__name__ == "Hear":
                heard.append(command.pcm)
            return await do(command)

        session.core.do = record
        for at in range(0, len(alaw_in), 160):
            carrier.media(alaw_in[at:at + 160])
        carrier.dtmf("#")
        await carrier.wait(lambda sent: len([m for m in sent if m["event"] == "mark"]) >= 2)
        carrier.stop()
        await asyncio.wait_for(served, 30)
        return carrier

    carrier = asyncio.run(go())
    media = carrier.of("media")
    assert media and "streamSid" not in media[0] and carrier.close_code == 1000
    # in: the conversation heard the tone
    got = np.concatenate(heard).astype(np.float64)
    assert len(got) >= 0.9 * len(tone16k)  # the decoder's resampler may still hold its last few ms
    assert error(got[1000:], tone16k.astype(np.float64)[1000:]) < 0.1  # past the resampler's start
    # out: the carrier got A-law of the TTS's tone
    alaw_out = b"".join(base64.b64decode(m["media"]["payload"]) for m in media)
    made = resample_poly(np.concatenate([p for call in spy.calls for p in call["pcm"]]).astype(np.float64), 1, 3)

    as_alaw = np.frombuffer(audioop.alaw2lin(alaw_out, 2), "<i2").astype(np.float64)
    as_ulaw = np.frombuffer(audioop.ulaw2lin(alaw_out, 2), "<i2").astype(np.float64)
    assert error(as_alaw, made) < 0.1 and error(as_ulaw, made) > 1.0


def error(got: np.ndarray, reference: np.ndarray, lags: int = 60) -> float:
    """How far ``got`` is from ``reference``: the RMS of the difference over the reference's RMS,
    at the best delay of up to ``lags`` samples either way (resamplers delay a signal a little)."""
    n = min(len(got), len(reference)) - 2 * lags
    ref = reference[lags:lags + n]
    return min(float(np.sqrt(np.mean((got[lags + lag:lags + lag + n] - ref) ** 2) / np.mean(ref ** 2)))
               for lag in range(-lags, lags + 1))


def test_the_test_carrier_speaks_twilio_as_pipecat_reads_it_and_we_write_as_pipecat_does():
    """Cross-check with Pipecat's TwilioFrameSerializer (pipecat-ai, installed for Smart Turn): the
    media and key messages the test carrier writes deserialize there to audio and a key, and our
    media and clear messages have the shape its serializer writes."""
    from pipecat.frames.frames import InputAudioRawFrame, InputDTMFFrame, InterruptionFrame, OutputAudioRawFrame
    from pipecat.serializers.twilio import TwilioFrameSerializer

    from pipeline.adapters.phone.carriers import Twilio

    async def go():
        ser = TwilioFrameSerializer(STREAM, params=TwilioFrameSerializer.InputParams(auto_hang_up=False,
                                                                                     sample_rate=16_000))
        await ser.setup(SimpleNamespace(audio_in_sample_rate=16_000))  # all its setup reads
        carrier = Carrier()
        tone = (8000 * np.sin(np.arange(3200) * 2 * np.pi * 440 / 16_000)).astype(np.int16)
        carrier.media(_ulaw(tone))
        carrier.dtmf("7")
        audio = await ser.deserialize(carrier.inbox.get_nowait())
        key = await ser.deserialize(carrier.inbox.get_nowait())
        theirs_media = json.loads(await ser.serialize(OutputAudioRawFrame(tone.tobytes(), 16_000, 1)))
        theirs_clear = json.loads(await ser.serialize(InterruptionFrame()))
        return audio, key, theirs_media, theirs_clear

    audio, key, theirs_media, theirs_clear = asyncio.run(go())
    assert isinstance(audio, InputAudioRawFrame) and len(audio.audio) > 0
    assert isinstance(key, InputDTMFFrame) and key.button.value == "7"
    ours = Twilio.media(STREAM, b"\xff" * 160)
    assert ours.keys() == theirs_media.keys() and ours["media"].keys() == theirs_media["media"].keys()
    assert Twilio.clear(STREAM) == theirs_clear


@pytest.fixture(scope="module")
def api():
    server = FakeCarrierAPI().start()
    yield server
    server.stop()


CALL_PATHS = {"twilio": f"/2010-04-01/Accounts/AC0/Calls/{CALL}.json", "telnyx": f"/v2/calls/{CALL}/actions/"}


@pytest.mark.parametrize("provider", ["twilio", "telnyx"])
def test_end_call_hangs_up_through_the_carriers_api_and_closes_the_stream(engines, api, provider):  # noqa: F811
    """The agent answers (speaks_first) with a forced end_call: the call's history records it, the
    carrier's REST API (the official client, against the fake) is asked to hang up this call,
    and the stream closes 1000."""
    api.requests.clear()
    carrier, session = asyncio.run(_agent_call(_fresh(engines), provider, "hangs_up", api))
    assert carrier.close_code == 1000 and carrier.close_reason == "call ended by the agent"
    path = CALL_PATHS[provider] + ("hangup" if provider == "telnyx" else "")
    assert api.requests == [("POST", path, {"Status": "completed"} if provider == "twilio" else {})]
    (call,) = [i for i in session.core.shared.history.items if i.kind == "function_call"]
    outputs = [i.text for i in session.core.shared.history.items if i.kind == "function_call_output"]
    assert call.name == "end_call" and outputs == ["The call ends once this reply has played."]


@pytest.mark.parametrize("provider", ["twilio", "telnyx"])
def test_transfer_call_dials_a_configured_number_through_the_carriers_api(engines, api, provider):  # noqa: F811
    api.requests.clear()
    carrier, _ = asyncio.run(_agent_call(_fresh(engines), provider, "transfers", api))
    assert carrier.close_code == 1000 and carrier.close_reason == "call transferred to +15550001111"
    if provider == "twilio":
        (method, path, form), = api.requests
        assert path == CALL_PATHS["twilio"] and "<Dial>+15550001111</Dial>" in form["Twiml"]
    else:
        assert api.requests == [("POST", CALL_PATHS["telnyx"] + "transfer", {"to": "+15550001111"})]


def test_a_failed_hang_up_is_counted_and_the_stream_still_ends(engines, api):  # noqa: F811
    api.requests.clear()
    api.fail = True
    errors = Errors()
    try:
        carrier, session = asyncio.run(_agent_call(_fresh(engines), "twilio", "hangs_up", api, observer=errors))
    finally:
        api.fail = False
    assert api.requests and carrier.close_code == 1000  # Twilio ends a call whose stream ends
    assert errors.codes == ["call_control_failed"]


def test_keys_answer_collect_digits_and_are_no_turn_of_their_own(engines, api):  # noqa: F811
    """dtmf: tool: keys pressed go to the collect_digits call (ended by #), not into turns."""
    def press(carrier):
        for key in "42#":
            carrier.dtmf(key)

    async def go():
        carrier = Carrier()
        carrier.connected()
        carrier.start(parameters={"agent": "collects"})
        press(carrier)
        served, registry = await _call(_fresh(engines), carrier, cfg=_cfg(engine_timeout_s=5.0), phone=AGENTS,
                                       calls=_calls("twilio", api))
        session = await registry.first()
        await _until(session, lambda: any(i.kind == "function_call_output" for i in session.core.shared.history.items))
        carrier.stop()
        await asyncio.wait_for(served, 30)
        return session.core.shared.history.items

    items = asyncio.run(go())
    calls = [i for i in items if i.kind == "function_call" and i.name == "collect_digits"]
    outputs = [i for i in items if i.kind == "function_call_output"]
    max_digits = json.loads(calls[0].arguments)["max_digits"]
    assert outputs[0].call_id == calls[0].call_id and outputs[0].text == "42"[:max_digits]
    assert not [i for i in items if i.role == "user"]  # the keys made no user turn


def test_a_call_takes_its_agents_settings_and_an_unknown_agent_is_refused(engines, api):  # noqa: F811
    async def go():
        carrier = Carrier()
        carrier.connected()
        carrier.start(parameters={"agent": "plain", "voice": "default"})
        served, registry = await _call(_fresh(engines), carrier, phone=AGENTS)
        session = await registry.first()
        carrier.dtmf("1")  # a turn: its reply's first audio shows the call has started
        await carrier.wait(lambda sent: any(m["event"] == "media" for m in sent))
        agent = session.core.shared.agent
        carrier.stop()
        await asyncio.wait_for(served, 30)
        unknown = Carrier()
        unknown.start(parameters={"agent": "nobody"})
        served, _ = await _call(_fresh(engines), unknown, phone=AGENTS)
        await asyncio.wait_for(served, 30)
        return agent, unknown

    agent, unknown = asyncio.run(go())
    assert agent.instructions == "You answer the phone for a bakery." and not agent.tools
    assert unknown.close_code == 1008 and "'nobody'" in unknown.close_reason


def test_the_agent_hangs_up_only_once_its_goodbye_has_played(api):
    """Scripted engines (tests/test_conversation.py): the reply says ten words (800 ms of audio),
    then calls end_call. The carrier plays at real time and echoes each mark as it plays: the
    hang-up reaches the carrier's API after the last echo, not when the reply was generated."""
    from pipeline.engines import ToolCall
    from tests.test_conversation import Engines

    goodbye = "Thank you for calling, goodbye and have a lovely day now. "
    scripted = Engines([goodbye, ToolCall("call_1", "end_call", "{}")], [])
    agents = read_phone_section({"agents": {"polite": {"tools": ["end_call"]}}})

    async def go():
        carrier = Carrier(play=True)
        carrier.connected()
        carrier.start(parameters={"agent": "polite"})
        carrier.dtmf("1")
        served, _ = await _call(scripted, carrier, phone=agents, calls=_calls("twilio", api))
        await asyncio.wait_for(served, 30)
        return carrier

    api.requests.clear()
    api.arrived.clear()
    carrier = asyncio.run(go())
    assert carrier.close_code == 1000 and len(carrier.echoed_at) == len(carrier.of("mark")) >= 10
    assert len(api.requests) == 1 and api.arrived[0] >= carrier.echoed_at[-1]


def test_the_simulated_phone_counts_a_reply_after_a_clear_as_a_new_reply_not_dead_air():
    """load/phone.py's playback model, which the e2e call and load.phone measure with: a 20 ms
    frame arriving after the queue ran dry is dead air inside a reply, but after a ``clear`` the
    reply is over, and the next frame (however soon) begins the next reply."""
    frame = b"\xff" * 160  # 20 ms of μ-law
    phone = Phone()
    for i in range(5):
        phone._receive_media(frame, 10.0 + 0.01 * i)  # 100 ms queued by 10.04
    phone._receive_media(frame, 10.3)  # the queue ran dry at 10.1: 200 ms of dead air
    assert phone.first_audio_after == [10.0] and phone.gaps == pytest.approx([0.2])
    phone._receive_clear(10.35)
    phone._receive_media(frame, 11.0)  # 0.7 s after the last frame, within a reply's pause
    assert phone.first_audio_after == [10.0, 11.0] and phone.gaps == pytest.approx([0.2])


class Door:
    """The gateway's side of a stream's start, recorded (what ``StreamAdmission`` does)."""

    def __init__(self, registry_of=None):
        self.events: list[str] = []

    def verified(self) -> None:
        self.events.append("verified")


def test_a_stream_holds_no_session_until_its_start_shows_a_good_credential(engines):  # noqa: F811
    """A stream that never starts is closed at start_within_s; one whose credential is refused is
    closed at once: neither ever becomes a session (the registry holds nothing for them, and the
    door never verified them). A good one is verified at the door before its session exists."""
    backends = _fresh(engines)

    async def go():
        out = {}
        for name, send in {"silent": lambda c: c.connected(),
                           "forged": lambda c: c.start(parameters={"ticket": "forged"}),
                           "good": lambda c: c.start(parameters={"ticket": "good"})}.items():
            carrier, door = Carrier(), Door()
            send(carrier)
            served, registry = await _call(backends, carrier, _verifier({"good"}), door=door, start_within_s=0.5)
            if name == "good":
                session = await registry.first()
                out["verified before the session"] = list(door.events)
                carrier.stop()
                assert session is not None
            started = time.monotonic()
            await asyncio.wait_for(served, 30)
            out[name] = (carrier.close_code, carrier.close_reason, door.events, len(registry.opened),
                         time.monotonic() - started)
        return out

    out = asyncio.run(go())
    assert out["silent"][:4] == (1008, "no start within 0.5 s", [], 0) and out["silent"][4] >= 0.4
    assert out["forged"][:4] == (1008, "unauthorized", [], 0)
    assert out["verified before the session"] == ["verified"]
    assert out["good"][:4] == (1000, "call ended", ["verified"], 1)


def _starts() -> dict[str, dict]:
    """Each carrier's start message as its documentation shows it (what Carrier.start sends)."""
    out = {}
    for provider in ("twilio", "telnyx"):
        carrier = Carrier(provider)
        carrier.start(parameters={"agent": "plain", "ticket": "t"})
        out[provider] = json.loads(carrier.inbox.get_nowait())
    return out


def test_a_carrier_message_of_wrong_types_at_any_level_closes_its_stream_with_a_reason_never_failing_inside():
    """Every place of each carrier's start (and of media, dtmf and mark messages), each replaced by
    every wrong JSON type: reading it raises StreamError (the stream closes 1008 with the reason)
    or passes; nothing else. Among them: Telnyx's media_format.encoding as a list, and a custom
    parameter's name as a list (both closed the stream 1011 before)."""
    from pipeline.adapters.phone.adapter import parse
    from pipeline.adapters.phone.carriers import DIALECTS, StreamError, digit, mark_name, payload
    from tests.test_realtime import WRONG_TYPES, _paths, _with

    readers = {"start": None, "media": payload, "dtmf": digit, "mark": mark_name}
    messages = {("twilio", "media"): Twilio_media(), ("twilio", "dtmf"): {"event": "dtmf", "dtmf": {"digit": "1"}},
                ("twilio", "mark"): {"event": "mark", "mark": {"name": "m"}}}
    for provider, start in _starts().items():
        messages[(provider, "start")] = start
    tried = refused = 0
    for (provider, kind), message in messages.items():
        read = readers[kind] or DIALECTS[provider].start
        for path in _paths(message):
            for wrong in WRONG_TYPES:
                tried += 1
                try:
                    read(parse(json.dumps(_with(message, path, wrong))))
                except StreamError as exc:
                    assert exc.reason, (provider, kind, path, wrong)
                    refused += 1
    assert tried > 400 and refused > tried / 3
    telnyx = _starts()["telnyx"]
    for path in [("start", "media_format", "encoding"), ("start", "custom_parameters", 0, "name"),
                 ("start", "custom_parameters", 0, "value")]:
        bad = _with(telnyx, path, ["PCMU"])
        try:
            DIALECTS["telnyx"].start(bad)
            raise AssertionError(f"{path} as a list was taken")
        except StreamError as exc:
            assert path[-1] in exc.reason or "custom_parameters" in exc.reason, exc.reason


def Twilio_media() -> dict:
    carrier = Carrier()
    carrier.media(b"\xff" * 160)
    return json.loads(carrier.inbox.get_nowait())
