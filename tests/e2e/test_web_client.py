"""The web client (web/) in real Chromium against the real app: a person's first session.

Chromium's fake microphone plays an espeak sentence into getUserMedia; the page streams it
hands-free (the server's VAD and Smart Turn end the turn), plays the reply through its
AudioWorklet, then takes typed turns, one of which interrupts the reply before it. What the page
measured is read from window.gapless (web/app.js). The screenshot is saved in out/.
"""
from __future__ import annotations

from pathlib import Path

from load import browser, speech
from tests.e2e.serve_process import PORT, ROOT

PAGE = f"http://127.0.0.1:{PORT}/?jitter_ms=120"
SCREENSHOT = ROOT / "out" / "web-client.png"
SECOND = 24_000  # reply samples in one second


def test_web_client_in_chromium(server, tmp_path: Path):
    mic = speech.padded(speech.espeak("I would like to book a flight to Paris on Friday."), 1.0, 6.0)
    with browser.Page(PAGE, browser.write_mic_wav(tmp_path / "mic.wav", mic)) as page:
        page.connect()
        s = page.state()
        assert s["status"].startswith("connected"), (s["status"], s["errors"], page.console)
        assert s["microphone"]["sampleRate"] == 16_000
        assert s["microphone"]["settings"]["echoCancellation"] is True

        # 1. A spoken turn, hands-free: its transcript.final shows on the page, its reply plays.
        spoken = page.wait_turn_done(1, timeout_s=60)
        assert spoken["interrupted"] is False
        assert spoken["finalText"].strip()
        assert page.page.inner_text("#user-1").strip() == spoken["finalText"].strip()
        assert "partial" not in page.page.get_attribute("#user-1", "class")
        assert page.page.inner_text("#bot-1").strip()
        assert spoken["chunks"] > 0 and spoken["firstChunkMs"] is not None
        page.wait("g.started.some(x => x.turn === 1)")
        page.wait_played(SECOND)  # the worklet's played-sample counter advances
        s = page.state()
        assert isinstance(s["playback"]["underruns"], int)
        assert page.page.evaluate("() => !document.getElementById('speaker').paused")  # <audio> plays the stream

        # 2. A typed turn.
        page.wait("g.playback.buffered === 0", 30)  # the first reply has played out
        page.type_turn("Can you hear me?")
        typed = page.wait_turn_done(2)
        assert typed["finalText"] == "Can you hear me?"
        assert page.page.inner_text("#user-2") == "Can you hear me?"
        page.wait("g.started.some(x => x.turn === 2)")
        assert typed["firstPlayedMs"] is not None and typed["firstPlayedMs"] >= typed["firstChunkMs"]

        # 3. A turn that interrupts the reply playing: the buffered audio is dropped at once.
        page.wait("g.playback.buffered === 0", 30)
        page.type_turn("Tell me a long story.")
        page.wait("g.started.some(x => x.turn === 3)", 30)
        page.type_turn("Stop, please.")
        page.wait("g.turns[3] && g.turns[3].interrupted === true", 30)
        page.wait("g.started.some(x => x.turn === 4)", 30)
        s = page.state()
        bot3_class = page.page.get_attribute("#bot-3", "class")
        page.screenshot(SCREENSHOT)

    flush = [f for f in s["flushes"] if f["turn"] == 3]
    assert len(flush) == 1 and flush[0]["dropped"] > 0, s["flushes"]
    fourth = next(x for x in s["started"] if x["turn"] == 4)
    assert fourth["played"] == flush[0]["played"]  # nothing of turn 3 played after the flush
    assert "interrupted" in bot3_class
    assert s["turns"]["4"]["finalText"] == "Stop, please."
    assert s["errors"] == [], s["errors"]
    assert not [c for c in page.console if c.startswith("pageerror")], page.console
