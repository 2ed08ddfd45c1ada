"""WebRTC calls against `serve run` (docs/webrtc.md): an aiortc client written from OpenAI's WebRTC
documentation (load/webrtc_client.py), on loopback with no ICE servers, POSTs its offer to
/v1/realtime/calls and talks: a spoken turn heard over its track, the events on ``oai-events``, a
barge-in that stops the reply track, a typed turn, and the hang-up. Bad offers each get their HTTP
error while a witness conversation beside them goes on."""
from __future__ import annotations

import asyncio

import httpx

from load import speech
from load.client import Conversation
from load.webrtc_client import RtcCall
from tests.door_attacks import offer_sdp
from tests.e2e import observed
from tests.e2e.serve_process import PORT, URL

BASE = f"http://127.0.0.1:{PORT}"


def run(coro, timeout: float = 120):
    return asyncio.run(asyncio.wait_for(coro, timeout))


def _types(call: RtcCall) -> list[str]:
    return [e["type"] for e in call.events]


def _settled(call: RtcCall) -> bool:
    """Every response created is done."""
    return len(call.of("response.created")) == len(call.of("response.done"))


def test_a_call_talks_is_cut_in_on_takes_a_typed_turn_and_hangs_up(server):
    question = speech.padded(speech.espeak("Tell me a long story about the old lighthouse."), 0.2, 1.5)
    cut_in = speech.padded(speech.espeak("Stop."), 0.0, 1.5)
    before = {name: observed.count(name, transport="webrtc") for name in ("voice_voice_to_voice_seconds",
                                                                          "voice_barge_in_seconds")}

    async def go():
        async with RtcCall(BASE, session={"instructions": "Answer briefly.", "max_output_tokens": 12}) as call:
            await call.wait(lambda c: c.of("session.created"))
            await call.say(question)
            await call.wait(lambda c: len(c.loud_after(0)) >= 25)  # half a second of the reply, heard
            spoken_reply = call.of("response.created")[0]["response"]["id"]
            await call.say(cut_in)
            await call.wait(lambda c: c.of("output_audio_buffer.cleared"))
            cleared_at = call.event_times[_types(call).index("output_audio_buffer.cleared")]
            await call.wait(lambda c: any(e["response"]["id"] == spoken_reply for e in c.of("response.done")))
            cut = next(e["response"] for e in call.of("response.done") if e["response"]["id"] == spoken_reply)
            await call.wait(lambda c: _settled(c) and len(c.of("response.done")) >= 2)  # the cut-in's own reply
            call.send({"type": "conversation.item.create", "item": {"type": "message", "role": "user", "content": [
                {"type": "input_text", "text": "And what happened next?"}]}})
            call.send({"type": "response.create"})
            await call.wait(lambda c: _settled(c) and len(c.of("response.done")) >= 3)
            async with httpx.AsyncClient() as client:
                hang_up = await client.post(f"{BASE}{call.location}/hangup")
            await asyncio.wait_for(call.closed.wait(), 30)
            return call, cut, cleared_at, hang_up

    call, cut, cleared_at, hang_up = run(go())
    types = _types(call)
    assert types[0] == "session.created" and call.events[0]["session"]["instructions"] == "Answer briefly."
    assert "conversation.item.input_audio_transcription.completed" in types
    assert "response.output_audio.delta" not in types  # the audio went over the track
    assert cut["status"] == "cancelled"
    # the reply track went quiet within 200 ms of the cut (loopback: no network in between), until
    # the next reply's audio began
    after_cut = types.index("output_audio_buffer.cleared")
    next_started = call.event_times[types.index("output_audio_buffer.started", after_cut)]
    assert [t for t in call.loud_after(cleared_at + 0.2) if t < next_started] == []
    assert call.loud_after(next_started)  # and the next reply was heard
    done = call.of("response.done")
    # the cut-in's reply and the typed turn's played to their end (max_output_tokens: "incomplete")
    assert [d["response"]["status"] for d in done[-2:]] != ["cancelled"] * 2
    assert {d["response"]["status"] for d in done[-2:]} <= {"completed", "incomplete"}
    assert hang_up.status_code == 200 and call.closed.is_set()
    # the operator's view: WebRTC's voice-to-voice and barge-in, and the call's record
    after = {name: observed.count(name, transport="webrtc") for name in before}
    assert after["voice_voice_to_voice_seconds"] >= before["voice_voice_to_voice_seconds"] + 2
    assert after["voice_barge_in_seconds"] >= before["voice_barge_in_seconds"] + 1
    rec = observed.record(call.of("session.created")[0]["session"]["id"], lambda r: len(observed.replies(r)) >= 3)
    assert rec["transport"] == "webrtc"
    assert any(r["status"] == "cancelled" and r["barge_in_ms"] for r in observed.replies(rec))


def test_bad_offers_get_their_http_error_and_a_conversation_beside_them_goes_on(server):
    async def go():
        with_audio = await offer_sdp(audio=True)
        offers = {
            "invalid_sdp": "this is not SDP",
            "no_audio": await offer_sdp(audio=False),
            # the audio section with every line naming Opus removed: PCMU and PCMA are left
            "unsupported_codec": "\r\n".join(line for line in with_audio.split("\r\n") if "opus" not in line.lower()),
        }
        answers = {}
        async with Conversation(URL) as witness:
            turn = asyncio.ensure_future(witness.say_text("Hello there."))  # the offers come while it is answered
            async with httpx.AsyncClient(timeout=30) as client:
                for code, sdp in offers.items():
                    answers[code] = await client.post(f"{BASE}/v1/realtime/calls", content=sdp,
                                                      headers={"Content-Type": "application/sdp"})
            answered = await turn
        return answers, answered

    answers, answered = run(go())
    assert {code: (a.status_code, a.json()["error"]["code"]) for code, a in answers.items()} == {
        code: (400, code) for code in answers}
    assert answered.audio_s > 0 and answered.interrupted is False and max(answered.gaps, default=0) < 0.5


class SdkCall(RtcCall):
    """The aiortc peer, its offer POSTed by OpenAI's own Python SDK (``client.realtime.calls``)
    with only the base URL changed: what a client written for OpenAI's WebRTC interface sends."""

    async def post_offer(self, sdp: str):
        from openai import AsyncOpenAI

        self.sdk = AsyncOpenAI(base_url=f"{self.base_url}/v1", api_key="any-key-with-auth-off")
        answer = await self.sdk.realtime.calls.with_raw_response.create(sdp=sdp, session=self.session)
        return answer.http_response


def test_openais_sdk_places_the_call_and_hangs_it_up(server):
    async def go():
        async with SdkCall(BASE, session={"type": "realtime", "instructions": "Be brief.",
                                          "max_output_tokens": 8}) as call:
            await call.wait(lambda c: c.of("session.created"))
            call.send({"type": "conversation.item.create", "item": {"type": "message", "role": "user", "content": [
                {"type": "input_text", "text": "Hello?"}]}})
            call.send({"type": "response.create"})
            await call.wait(lambda c: c.of("response.done") and len(c.loud_after(0)) >= 10)
            await call.sdk.realtime.calls.hangup(call.location.rsplit("/", 1)[1])
            await asyncio.wait_for(call.closed.wait(), 30)
            return call

    call = run(go())
    assert call.events[0]["session"]["instructions"] == "Be brief."
    assert call.of("response.done")[0]["response"]["status"] in ("completed", "incomplete")
