"""WebRTC calls in-process (pipeline/adapters/webrtc/peer.py, pipeline/adapters/webrtc/adapter.py): a real aiortc
peer pair on loopback, the server's session over scripted engines (tests/test_conversation.py),
so what the reply says, clause by clause, is known. (Against `serve run`: tests/e2e/test_webrtc.py.)"""
from __future__ import annotations

import asyncio
import ipaddress
import socket

import numpy as np
import pytest
from aiortc import RTCPeerConnection

from load.webrtc_client import RtcCall
from pipeline.adapters.webrtc import peer as webrtc_peer
from pipeline.adapters.webrtc.adapter import WebRTCSession
from pipeline.connection import SessionRegistry, serve_connection
from pipeline.audio_constants import REPLY_RATE
from pipeline.session_config import SessionConfig
from tests.test_conversation import Engines


class DirectCall(RtcCall):
    """The aiortc client, its offer answered by an in-process Peer served by ``engines``."""

    def __init__(self, engines, **kwargs):
        super().__init__(**kwargs)
        self.engines = engines
        self.cfg = SessionConfig(turn_detection="manual", pace_lead_s=0.6, vad_events=False, barge_in="off")

    async def post_offer(self, sdp: str):
        self.peer = webrtc_peer.Peer()
        answer = await self.peer.answer(sdp)
        self.served = asyncio.ensure_future(serve_connection(self.peer, self.engines, self.cfg, SessionRegistry(2),
                                                             WebRTCSession, peer=self.peer, session=self.session))

        class Answer:
            text, headers = answer, {"location": f"/v1/realtime/calls/{self.peer.id}"}

            def raise_for_status(self):
                pass

        return Answer()


class Loud(Engines):
    """The scripted engines, with a 440 Hz tone for each word's 80 ms (Opus keeps a tone)."""

    async def tts_stream(self, text, context, voice=None):
        tone = (8000 * np.sin(np.arange(1920) * 2 * np.pi * 440 / REPLY_RATE)).astype(np.int16)
        for _ in text.split():
            yield tone, np.zeros((1, 32), np.int64)


def test_a_cut_reply_keeps_what_the_track_played_not_all_it_said():
    """A reply of three clauses (ten words, 800 ms of audio, each) is sent 0.6 s ahead of real time
    (pace_lead_s) into the reply track, which plays it at real time. The client cancels it once the
    caller has heard 0.4 s of it: the first clause only had begun playing, while the second had
    been sent too. The cut response's transcript and the history keep the first clause."""
    clauses = ["One two three four five six seven eight nine ten.",
               "Eleven twelve thirteen fourteen fifteen sixteen seventeen eighteen nineteen twenty.",
               "Red orange yellow green blue indigo violet black white grey."]
    engines = Loud([" ".join(clauses)])

    async def go():
        async with DirectCall(engines) as call:
            await call.wait(lambda c: c.of("session.created"))
            call.send({"type": "response.create"})
            await call.wait(lambda c: len(c.loud_after(0)) >= 20)  # 0.4 s heard
            call.send({"type": "response.cancel"})  # what a client does when its user interrupts
            await call.wait(lambda c: c.of("response.done"))
            call.send({"type": "conversation.item.retrieve", "item_id": call.of("response.done")[0]["response"][
                "output"][0]["id"]})
            await call.wait(lambda c: c.of("conversation.item.retrieved"))
            cleared_at = call.event_times[[e["type"] for e in call.events].index("output_audio_buffer.cleared")]
            await call.wait(lambda c: c.heard[-1][0] > cleared_at + 0.8)  # the track runs on, silent
            return call, cleared_at

    call, cleared_at = asyncio.run(go())
    cut = call.of("response.done")[0]["response"]
    assert cut["status"] == "cancelled" and cut["output"][0]["content"][0]["transcript"] == clauses[0]
    kept = call.of("conversation.item.retrieved")[0]["item"]
    assert kept["content"][0]["transcript"] == clauses[0]
    # the 0.6 s sent ahead was dropped from the track at the cut: nothing loud came 200 ms later
    assert call.loud_after(cleared_at + 0.2) == [] and call.loud_after(0)


def test_a_peer_whose_ice_never_connects_is_closed_in_bounded_time(monkeypatch):
    monkeypatch.setattr(webrtc_peer, "ICE_CONNECT_WITHIN_S", 0.5)

    async def go():
        client = RTCPeerConnection()
        client.addTransceiver("audio")
        client.createDataChannel("oai-events")
        await client.setLocalDescription(await client.createOffer())
        peer = webrtc_peer.Peer()
        await peer.answer(client.localDescription.sdp)
        await client.close()  # the answer is never applied: ICE cannot connect
        end = await asyncio.wait_for(peer.receive(), 10)
        return end, peer

    end, peer = asyncio.run(go())
    assert end is None and peer.pc.connectionState == "closed"


@pytest.mark.parametrize("sdp, code", [("", "invalid_sdp"), ("hello", "invalid_sdp")])
def test_an_offer_that_is_not_sdp_is_refused(sdp, code):
    with pytest.raises(webrtc_peer.OfferRefused) as refused:
        webrtc_peer.check_offer(sdp)
    assert refused.value.code == code


def test_speech_over_a_reply_sent_whole_but_still_playing_clears_the_track_and_truncates_it():
    """The server holds the playback buffer on WebRTC: a reply of 2.4 s is sent whole at once
    (pace_lead_s 5 s) and completes, then plays at real time; the caller speaks over it (espeak,
    the real VAD, heard through DeepFilterNet3: the call's session asks for noise_reduction
    far_field). The rest is dropped from the track, and the item keeps what was heard."""
    from load import speech

    clauses = ["One two three four five six seven eight nine ten.",
               "Eleven twelve thirteen fourteen fifteen sixteen seventeen eighteen nineteen twenty.",
               "Red orange yellow green blue indigo violet black white grey."]
    engines = Loud([" ".join(clauses)], ["Fine."])
    words = speech.padded(speech.espeak("Wait a moment please."), 0.0, 0.5)

    async def go():
        call = DirectCall(engines, session={"audio": {"input": {"noise_reduction": {"type": "far_field"}, "turn_detection": {
            "type": "server_vad", "create_response": False, "interrupt_response": True}}}})
        call.cfg = SessionConfig(pace_lead_s=5.0)
        async with call:
            await call.wait(lambda c: c.of("session.created"))
            call.send({"type": "response.create"})
            await call.wait(lambda c: c.of("response.done") and len(c.loud_after(0)) >= 10)
            assert call.of("response.done")[0]["response"]["status"] == "completed"
            await call.say(words)
            await call.wait(lambda c: c.of("conversation.item.truncated"))
            truncated_at = call.event_times[[e["type"] for e in call.events].index("conversation.item.truncated")]
            await call.wait(lambda c: c.heard[-1][0] > truncated_at + 0.8)
            return call, truncated_at

    call, truncated_at = asyncio.run(go())
    assert call.of("session.created")[0]["session"]["audio"]["input"]["noise_reduction"] == {"type": "far_field"}
    truncated = call.of("conversation.item.truncated")[0]
    assert 0 < truncated["audio_end_ms"] < 2400 and call.of("output_audio_buffer.cleared")
    assert call.loud_after(truncated_at + 0.2) == []  # the rest of the reply never played


def _offer_with(candidates: list[str]) -> str:
    """A minimal audio offer (Opus) carrying ``candidates`` (a=candidate lines' values)."""
    lines = ["v=0", "o=- 1 1 IN IP4 0.0.0.0", "s=-", "t=0 0", "a=group:BUNDLE 0", "a=ice-ufrag:abcd",
             "a=ice-pwd:abcdefghijklmnopqrstuvwx", "a=fingerprint:sha-256 " + ":".join(["AB"] * 32), "a=setup:actpass",
             "m=audio 9 UDP/TLS/RTP/SAVPF 111", "c=IN IP4 0.0.0.0", "a=mid:0", "a=sendrecv", "a=rtcp-mux",
             "a=rtpmap:111 opus/48000/2"]
    return "\r\n".join(lines + [f"a=candidate:{c}" for c in candidates] + ["a=end-of-candidates"]) + "\r\n"


def test_an_offer_with_more_candidates_than_a_browser_sends_is_refused():
    many = [f"{i} 1 udp 2122260223 93.184.{i // 250}.{i % 250 + 1} {10000 + i} typ host" for i in range(1100)]
    with pytest.raises(webrtc_peer.OfferRefused) as refused:
        webrtc_peer.check_offer(_offer_with(many[:webrtc_peer.MAX_CANDIDATES + 1]))
    assert refused.value.code == "too_many_candidates"
    with pytest.raises(webrtc_peer.OfferRefused) as refused:  # 1,100 of them (~65 KB): too large first
        webrtc_peer.check_offer(_offer_with(many))
    assert refused.value.code == "invalid_sdp" and str(webrtc_peer.MAX_SDP_BYTES) in refused.value.message
    sdp, dropped = webrtc_peer.check_offer(_offer_with(many[:webrtc_peer.MAX_CANDIDATES]))
    assert sdp.count("a=candidate:") == webrtc_peer.MAX_CANDIDATES and not dropped


def test_candidates_the_policy_refuses_are_dropped_by_reason():
    policy = webrtc_peer.IcePolicy(own=frozenset({ipaddress.ip_address("93.184.216.7"), ipaddress.ip_address("10.1.0.1")}),
                                   allowed=(ipaddress.ip_network("10.1.0.0/16"),))
    offer = _offer_with(["1 1 udp 1 127.0.0.1 5000 typ host", "2 1 udp 1 10.9.9.9 5000 typ host",
                         "3 1 udp 1 169.254.1.1 5000 typ host", "4 1 udp 1 224.0.0.251 5000 typ host",
                         "5 1 udp 1 ::1 5000 typ host", "6 1 udp 1 fe80::1 5000 typ host",
                         "7 1 udp 1 1f2e3d4c-aaaa.local 5000 typ host", "8 1 tcp 1 93.184.216.34 9 typ host tcptype active",
                         "9 1 udp 1 93.184.216.7 5000 typ host", "10 1 udp 1 10.1.2.3 5000 typ host",
                         "11 1 udp 1 93.184.216.34 5000 typ srflx raddr 10.0.0.2 rport 5000",
                         "12 1 udp 1 10.1.0.1 5000 typ host"])  # its own, inside the allowed network
    sdp, dropped = webrtc_peer.check_offer(offer, policy)
    kept = [line.split()[4] for line in sdp.splitlines() if line.startswith("a=candidate:")]
    assert kept == ["10.1.2.3", "93.184.216.34"]  # the allowed network, and a public address
    assert dict(dropped) == {"not_public": 6, "name": 1, "transport": 1, "own_host": 2}
    assert "a=end-of-candidates" not in sdp  # so that a caller is learnt from its own checks


def test_checks_go_only_where_the_policy_allows_and_a_caller_is_learnt_from_its_own_checks():
    """An offer's candidate at a loopback port where a UDP socket listens: under the default policy
    the server takes no remote candidate from it (nothing to send checks to), while allowing
    loopback sends a STUN binding request there. And a real caller whose every candidate is dropped
    (all of this machine's are private or loopback) still connects: the server learns it from the
    caller's own checks (peer-reflexive), as an ICE-lite server does."""
    async def go():
        listener = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        listener.bind(("127.0.0.1", 0))
        listener.setblocking(False)
        port = listener.getsockname()[1]
        offer = _offer_with([f"1 1 udp 2122260223 127.0.0.1 {port} typ host"])
        closed = webrtc_peer.Peer()
        await closed.answer(offer)
        remote_default = _remote_candidates(closed)
        await closed.close()
        opened = webrtc_peer.Peer(policy=webrtc_peer.IcePolicy(allowed=(ipaddress.ip_network("127.0.0.0/8"),)))
        await opened.answer(offer)
        remote_allowed = _remote_candidates(opened)
        stun = await asyncio.wait_for(asyncio.get_running_loop().sock_recv(listener, 2048), 10)
        await opened.close()
        listener.close()
        async with DirectCall(Engines(["Hello there."])) as call:  # every candidate of this machine dropped
            await call.wait(lambda c: c.of("session.created"))
            learnt = [c.type for c in _remote_candidates(call.peer)]
            dropped = sum(call.peer.dropped_candidates.values())
        return remote_default, remote_allowed, stun, learnt, dropped

    remote_default, remote_allowed, stun, learnt, dropped = asyncio.run(go())
    assert remote_default == [] and [(c.host, c.type) for c in remote_allowed] == [("127.0.0.1", "host")]
    assert stun[:2] == b"\x00\x01"  # a STUN Binding Request
    assert dropped > 0 and learnt and set(learnt) == {"prflx"}


def _remote_candidates(peer: webrtc_peer.Peer) -> list:
    """The remote candidates the server's ICE agent holds (aioice's Connection, under aiortc)."""
    transports = {t.receiver.transport.transport for t in peer.pc.getTransceivers()}
    return [c for t in transports for c in t._connection.remote_candidates]


def test_a_paused_reply_waits_on_the_track_and_plays_on_from_where_it_stopped():
    """resume_false_interruption on a call: the session's ReplyPaused holds the reply track (it
    sends silence, its queued audio kept); ReplyResumed plays on from the next sample, so the
    caller hears every sample once, in order, with the pause between."""
    from types import SimpleNamespace

    from pipeline.conversation import events as CE

    track = webrtc_peer.ReplyTrack()
    session = WebRTCSession(lambda ev: asyncio.sleep(0), Engines(["Hi."]), SessionConfig(),
                            peer=SimpleNamespace(speaker=track))
    reply = SimpleNamespace(id="resp_1", item_id="item_1")
    audio = np.arange(1, 4 * webrtc_peer.REPLY_FRAME + 1).astype(np.int16)
    track.push("item_1", audio)

    async def go():
        out = [track.next_frame()]
        await session.emit(CE.ReplyPaused(reply))
        out += [track.next_frame() for _ in range(3)]
        paused_sent = track.sent
        await session.emit(CE.ReplyResumed(reply))
        out += [track.next_frame() for _ in range(3)]
        return np.concatenate(out), paused_sent

    played, paused_sent = asyncio.run(go())
    frame = webrtc_peer.REPLY_FRAME
    assert paused_sent == ("item_1", frame)  # what was heard when it paused
    assert not played[frame:4 * frame].any()  # silence while paused
    np.testing.assert_array_equal(np.concatenate([played[:frame], played[4 * frame:]]), audio)
    assert track.idle
