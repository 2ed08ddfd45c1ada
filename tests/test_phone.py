"""Phone calls over the conversation core (pipeline/adapters/phone.py), in-process with the tiny
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
from types import SimpleNamespace

import numpy as np
from scipy.signal import resample_poly

from pipeline.adapters.phone import PhoneSession
from pipeline.connection import SessionRegistry, serve_connection
from pipeline.session_config import SessionConfig
from tests.test_session import _fresh, engines  # noqa: F401 - the module's tiny engines (a slow LLM)

STREAM, CALL = "MZ00000000000000000000000000000001", "CA00000000000000000000000000000001"


class Carrier:
    """A carrier's side of one media stream, as the test drives it: messages to send queued in
    ``inbox``, what the server sends kept in ``sent``; marks are echoed when ``echo`` says."""

    def __init__(self, provider: str = "twilio", echo_marks: bool = True):
        self.provider = provider
        self.inbox: asyncio.Queue = asyncio.Queue()
        self.sent: list[dict] = []
        self.echo_marks = echo_marks
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
        if msg["event"] == "mark" and self.echo_marks:
            self.inbox.put_nowait(json.dumps(self._echo(msg["mark"]["name"])))
        async with self._arrived:
            self._arrived.notify_all()

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


async def _call(backends, carrier: Carrier, verify=None, cfg: SessionConfig | None = None):
    registry = SessionRegistry(4)
    served = asyncio.create_task(serve_connection(carrier, backends, cfg or _cfg(), registry, PhoneSession,
                                                  provider=carrier.provider, verify=verify))
    return served, registry


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
        reply = session.core.reply
        await carrier.wait(lambda sent: len(reply.spoken) >= 2)  # a second clause went out, unheard
        carrier.dtmf("2")  # after the echoes: frames are handled in order
        await carrier.wait(lambda sent: any(m["event"] == "clear" for m in sent))
        carrier.stop()
        await asyncio.wait_for(served, 30)
        return carrier, session.core.history.messages(), reply, heard_bytes

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
    backends = _fresh(engines)

    async def go():
        carrier = Carrier("telnyx")
        carrier.connected()
        carrier.start(encoding="PCMA")
        served, _ = await _call(backends, carrier)
        carrier.dtmf("#")
        await carrier.wait(lambda sent: len([m for m in sent if m["event"] == "mark"]) >= 2)
        carrier.stop()
        await asyncio.wait_for(served, 30)
        return carrier

    carrier = asyncio.run(go())
    media = carrier.of("media")
    assert media and "streamSid" not in media[0] and carrier.close_code == 1000
    pcm = np.frombuffer(audioop.alaw2lin(b"".join(base64.b64decode(m["media"]["payload"]) for m in media), 2), "<i2")
    assert np.abs(pcm.astype(np.int32)).max() > 0  # A-law that decodes to sound


def test_the_test_carrier_speaks_twilio_as_pipecat_reads_it_and_we_write_as_pipecat_does():
    """Cross-check with Pipecat's TwilioFrameSerializer (pipecat-ai, installed for Smart Turn): the
    media and key messages the test carrier writes deserialize there to audio and a key, and our
    media and clear messages have the shape its serializer writes."""
    from pipecat.frames.frames import InputAudioRawFrame, InputDTMFFrame, InterruptionFrame, OutputAudioRawFrame
    from pipecat.serializers.twilio import TwilioFrameSerializer

    from pipeline.telephony import Twilio

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
