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
