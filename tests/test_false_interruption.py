"""False-interruption resume (``resume_false_interruption``) as each protocol asks for it: v1's
session option (tests/test_turn_taking.py), Realtime's and WebRTC's turn_detection extension, a
phone agent's setting. What each wire does with a pause: tests/test_phone.py, tests/test_webrtc.py."""
from __future__ import annotations

import asyncio

import pytest

from pipeline.adapters.phone.config import PhoneAgent
from pipeline.session_config import SessionConfig


def test_realtime_turn_detection_turns_resume_on_and_off_and_says_so():
    """The session starts with the server's setting in turn_detection; an update sets it (on either
    VAD type); a value that is not a boolean is refused naming the field and changes nothing."""
    from tests.test_conversation import Engines
    from tests.test_realtime import Wire, send
    from pipeline.adapters.realtime.adapter import RealtimeSession

    async def go():
        wire = Wire()
        s = RealtimeSession(wire, Engines(["Hello."]), SessionConfig(resume_false_interruption=True))
        await s.start()
        seen = [s.core.shared.cfg.resume_false_interruption]
        for detection in ({"type": "server_vad", "resume_false_interruption": False},
                          {"type": "semantic_vad", "resume_false_interruption": True},
                          {"type": "semantic_vad", "resume_false_interruption": "yes"}):
            await send(s, type="session.update", session={"audio": {"input": {"turn_detection": detection}}})
            seen.append(s.core.shared.cfg.resume_false_interruption)
        await s.close()
        return wire, seen

    wire, seen = asyncio.run(go())
    assert seen == [True, False, True, True]
    created = wire.of("session.created")[0]["session"]["audio"]["input"]["turn_detection"]
    assert created["resume_false_interruption"] is True
    assert [u["session"]["audio"]["input"]["turn_detection"]["resume_false_interruption"]
            for u in wire.of("session.updated")] == [False, True]
    assert wire.of("error")[-1]["error"]["param"] == "session.audio.input.turn_detection.resume_false_interruption"


def test_a_phone_agent_sets_resume_for_its_calls_and_a_bad_value_is_refused():
    assert PhoneAgent(resume_false_interruption=True).turn_taking_changes() == {"resume_false_interruption": True}
    assert PhoneAgent().turn_taking_changes() == {}  # unset: the server's
    with pytest.raises(ValueError, match="resume_false_interruption"):
        PhoneAgent(resume_false_interruption="sometimes")


def _webrtc_session(engines, cfg: SessionConfig):
    """A WebRTC session whose peer is only its reply track (nothing goes over a network)."""
    from types import SimpleNamespace

    from pipeline.adapters.webrtc.adapter import WebRTCSession
    from pipeline.adapters.webrtc.peer import ReplyTrack
    from tests.test_realtime import Wire

    wire = Wire()
    return WebRTCSession(wire, engines, cfg, peer=SimpleNamespace(speaker=ReplyTrack(), rtt_s=0.0)), wire


def test_a_webrtc_reply_paused_before_its_audio_and_then_cut_leaves_the_next_one_audible():
    """The caller speaks on while the LLM thinks: the reply is paused before it has any audio, then
    cut (a word that is no backchannel). The track must not stay held: the next reply is heard."""
    from tests.test_conversation import Engines
    from tests.test_realtime import send

    async def go():
        s, wire = _webrtc_session(Engines(["First answer here."], ["Second answer here."]),
                                  SessionConfig(resume_false_interruption=True, pace_lead_s=None))
        await s.start()
        track = s.peer.speaker
        replies = s.core.replies
        await send(s, type="response.create")
        assert replies.running and replies.reply.first_audio_at is None
        await replies.barge_in("")  # speech over it, before its first chunk: a pause
        await replies.interrupt(send_done=True)  # then words: a turn
        await send(s, type="response.create")
        await wire.wait("response.done", 2)
        frames = [track.next_frame() for _ in range(12)]
        await s.close()
        return frames, track

    frames, track = asyncio.run(go())
    assert not track.held and any(f.any() for f in frames)


def test_only_a_client_that_stops_playing_gets_its_echo_reference_held():
    """A Realtime WebSocket client plays out what it holds through a pause (no event tells it to
    stop): its echo reference stays as sent. v1, WebRTC and phone clients stop."""
    from tests.test_conversation import Engines
    from pipeline.adapters.realtime.adapter import RealtimeSession
    from tests.test_realtime import Wire

    assert RealtimeSession(Wire(), Engines(), SessionConfig()).core.replies.client_pauses is False
    assert _webrtc_session(Engines(), SessionConfig())[0].core.replies.client_pauses is True


def test_a_reply_paused_does_not_end_until_it_resumes():
    """A reply with nothing left to play (a text-only one here) is paused by speech: it does not end
    while paused (the speech would then be taken for a turn, and a wire would drop what it held); it
    ends, completed, once the speech proves no turn."""
    from tests.test_conversation import Engines
    from tests.test_realtime import Wire, send
    from pipeline.adapters.realtime.adapter import RealtimeSession

    async def go():
        wire = Wire()
        s = RealtimeSession(wire, Engines(["Just some text."]), SessionConfig(resume_false_interruption=True))
        await s.start()
        await send(s, type="session.update", session={"output_modalities": ["text"]})
        await send(s, type="response.create")
        replies = s.core.replies
        reply = replies.reply
        await replies.barge_in("")  # speech over it: paused
        await wire.wait("response.output_text.delta")  # its text was all made
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(asyncio.shield(reply.task), 0.5)  # yet it has not ended
        still = replies.paused and not wire.of("response.done")
        await replies.resume()
        await wire.wait("response.done")
        await s.close()
        return wire, still

    wire, still = asyncio.run(go())
    assert still and wire.of("response.done")[0]["response"]["status"] == "completed"
