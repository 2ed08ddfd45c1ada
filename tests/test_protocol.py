"""Protocol v1 parsing: every bad-input case maps to its stable error code."""
import msgpack
import numpy as np
import pytest

from pipeline.adapters.v1 import protocol as P

BAD_FRAMES = {
    "text frame": ("hello", P.E_TEXT_FRAME),
    "oversized": (b"\x00" * (P.MAX_FRAME_BYTES + 1), P.E_FRAME_TOO_LARGE),
    "not msgpack": (b"\xc1", P.E_BAD_MSGPACK),
    "truncated msgpack": (msgpack.packb({"type": "text", "text": "abc"})[:-2], P.E_BAD_MSGPACK),
    "not a map": (msgpack.packb([1, 2, 3]), P.E_NOT_A_MAP),
    "missing type": (msgpack.packb({"text": "hi"}), P.E_MISSING_FIELD),
    "type not str": (msgpack.packb({"type": 7}), P.E_WRONG_TYPE),
    "unknown type": (msgpack.packb({"type": "dance"}), P.E_UNKNOWN_TYPE),
    "audio without pcm": (msgpack.packb({"type": "audio"}), P.E_MISSING_FIELD),
    "pcm as str": (msgpack.packb({"type": "audio", "pcm": "abcd"}), P.E_WRONG_TYPE),
    "pcm empty": (msgpack.packb({"type": "audio", "pcm": b""}, use_bin_type=True), P.E_BAD_AUDIO),
    "pcm odd": (msgpack.packb({"type": "audio", "pcm": b"\x00" * 3}, use_bin_type=True), P.E_BAD_AUDIO),
    "pcm over 1 s": (msgpack.packb({"type": "audio", "pcm": b"\x00" * (P.MAX_AUDIO_BYTES + 2)}, use_bin_type=True), P.E_BAD_AUDIO),
    "text not str": (msgpack.packb({"type": "text", "text": 5}), P.E_WRONG_TYPE),
    "text missing": (msgpack.packb({"type": "text"}), P.E_MISSING_FIELD),
    "text too long": (msgpack.packb({"type": "text", "text": "a" * (P.MAX_TEXT_CHARS + 1)}), P.E_TEXT_TOO_LONG),
}


@pytest.mark.parametrize("name", sorted(BAD_FRAMES))
def test_bad_frames_give_stable_codes(name):
    frame, code = BAD_FRAMES[name]
    with pytest.raises(P.ProtocolError) as info:
        P.parse_client_frame(frame)
    assert info.value.code == code
    assert info.value.message


def test_good_frames_parse():
    pcm = (np.arange(1600) - 800).astype(np.int16)
    msg = P.parse_client_frame(P.client_audio(pcm))
    assert isinstance(msg, P.AudioIn) and msg.pcm.dtype == np.int16
    np.testing.assert_array_equal(msg.pcm, pcm)
    assert P.parse_client_frame(P.client_text("hi there")) == P.TextIn("hi there")
    assert P.parse_client_frame(P.client_turn_end()) == P.TurnEnd()
    # exactly one second of audio is allowed
    assert len(P.parse_client_frame(P.client_audio(np.zeros(16000, np.int16))).pcm) == 16000


def test_server_messages_roundtrip():
    pcm = np.array([1, -2, 32767, -32768], np.int16)
    out = P.unpack(P.pack(P.audio_out(pcm, turn=3, seq=5)))
    assert out["type"] == "audio" and out["turn"] == 3 and out["seq"] == 5
    np.testing.assert_array_equal(np.frombuffer(out["pcm"], "<i2"), pcm)
    ready = P.unpack(P.pack(P.session_ready("abc")))
    assert ready == {"type": "session.ready", "session_id": "abc", "input_sample_rate": 16000,
                     "output_sample_rate": 24000, "protocol_version": 1}
    assert P.session_ready("abc", voices=("default", "robot"))["voices"] == ["default", "robot"]
    assert P.unpack(P.pack(P.response_done(2, True))) == {"type": "response.done", "turn": 2, "interrupted": True}
    assert P.unpack(P.pack(P.error("x", "y"))) == {"type": "error", "code": "x", "message": "y"}
