"""The web client (web/) in real Chromium against the real app: a person's first session.

Chromium's fake microphone plays an espeak sentence into getUserMedia; the page streams it
hands-free (the server's VAD and Smart Turn end the turn), plays the reply through its
AudioWorklet, then takes typed turns, one of which interrupts the reply before it. What the page
measured is read from window.gapless (web/app.js). The screenshot is saved in out/.

What the page shows live of a call (web/live.js: the agent's state, the timeline, the server's
record of each turn in the turns table, the event log, the device pickers) is checked in the two
talking tests, on either transport (live_view_problems).

Then the page's edges: push-to-talk sends every captured sample before turn.end; the audio
runs at the rates session.ready announces, and a browser that cannot run audio at them is told
so and sends none; an error before session.ready is told once; a refused token is not "needs a
token".
What the page sent is read off the wire (RECORD_SENT wraps WebSocket.send), not from the page's
own accounting.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from load import browser, speech
from pipeline.adapters.v1 import protocol as P
from tests.e2e.serve_process import PORT, ROOT

BASE = f"http://127.0.0.1:{PORT}"
PAGE = f"{BASE}/?jitter_ms=120&transport=websocket"
SCREENSHOT = ROOT / "out" / "web-client.png"
SCREENSHOT_WEBRTC = ROOT / "out" / "web-client-webrtc.png"
SECOND = 24_000  # reply samples in one second
FRAME = 640  # samples in one 40 ms microphone frame at 16 kHz

# Every message the page sends, decoded: {type, t (performance.now()), samples (audio)}, in
# window.sent. Run on the loaded page, before it connects.
RECORD_SENT = """() => {
  window.sent = [];
  const send = WebSocket.prototype.send;
  WebSocket.prototype.send = function (data) {
    const msg = window.MessagePack.decode(data);
    window.sent.push({ type: msg.type, t: performance.now(), samples: msg.pcm ? msg.pcm.byteLength / 2 : 0 });
    return send.call(this, data);
  };
}"""

# Browsers that will not run the page's audio at the server's rates (as some do), made of
# Chromium: one whose AudioContext constructor refuses any sampleRate asked for, and one that
# makes the context but will not connect a microphone to it. Run on the loaded page, before it
# connects (web/audio.js looks AudioContext up when the session starts).
REFUSES_THE_RATE = {
    "constructor": """() => {
      const Native = window.AudioContext;
      window.AudioContext = class extends Native {
        constructor(options = {}) {
          if (options.sampleRate) throw new DOMException(`${options.sampleRate} Hz`, "NotSupportedError");
          super(options);
        }
      };
    }""",
    "microphone": """() => {
      AudioContext.prototype.createMediaStreamSource = () => {
        throw new DOMException("a context at another rate than the device's", "NotSupportedError");
      };
    }""",
}


def waited(page: browser.Page, js: str, timeout_s: float) -> bool:
    """page.wait, that says whether the condition came true instead of raising."""
    try:
        page.wait(js, timeout_s)
        return True
    except Exception:  # noqa: BLE001 - Playwright's TimeoutError: live_view_problems then says what is missing
        return False


def went_through(states: list[dict], turn: int) -> bool:
    """The agent's state history (window.gapless.agentStates) holds listening, then thinking, speaking
    and listening for `turn`, in that order (other states may come between)."""
    path = [("listening", None), ("thinking", turn), ("speaking", turn), ("listening", turn)]
    for s in states:
        state, of = path[0]
        if s["state"] == state and of in (None, s["turn"]):
            path.pop(0)
            if not path:
                return True
    return False


def live_view_problems(page: browser.Page, turn: int, logged: set[str]) -> list[str]:
    """What the page does not show live of the call (web/live.js), after `turn` (a spoken one)
    was answered: empty when everything is there. Every check is made and reported together."""
    waited(page, f"g.record && g.recordTurns[{turn}] && g.recordTurns[{turn}].voice_to_voice_ms > 0", 20)
    waited(page, "g.timeline.drawn && g.timeline.drawn.speech >= 1 && g.timeline.drawn.reply >= 1", 5)
    s = page.state()
    problems = []
    states = s["agentStates"]
    if not went_through(states, turn) or len(states) > 200:
        problems.append(f"agent states: {[(x['state'], x['turn']) for x in states]}")
    drawn = s["timeline"].get("drawn", {})
    if not (drawn.get("speech", 0) >= 1 and drawn.get("reply", 0) >= 1):
        problems.append(f"timeline drew {s['timeline']}")
    record_turn = next((t for t in (s["record"] or {}).get("turns", []) if t["turn"] == turn), None)
    reply = next((r for r in (record_turn or {}).get("replies", []) if r["voice_to_voice_ms"]), None)
    cells = page.page.evaluate(f"""() => Object.fromEntries([...document.querySelectorAll('#row-{turn} td[data-k]')]
                                                           .map(td => [td.dataset.k, td.textContent]))""")
    if reply is None or not reply["voice_to_voice_ms"] > 0:
        problems.append(f"record: turn {turn} has no reply with a voice-to-voice time: {record_turn}")
    elif (cells.get("v2v"), cells.get("audio")) != (f"{reply['voice_to_voice_ms']} ms",
                                                    f"{reply['timings'].get('first_audio_ms')} ms"):
        problems.append(f"turns table row {turn}: {cells}, the record: {reply}")
    log = s["log"]
    shown = page.page.locator("#events li").count()
    if not logged <= {e["type"] for e in log} or not 0 < shown == len(log) <= 200 or log[0]["t"] < log[-1]["t"]:
        problems.append(f"event log ({shown} shown): {log[:5]} … {log[-5:]}")
    mics = s["devices"].get("microphones", [])
    if not mics or page.page.locator("#mic option").count() != len(mics) + 1:
        problems.append(f"microphones: {s['devices']}")
    return problems


def test_web_client_in_chromium(server, tmp_path: Path):
    mic = speech.padded(speech.espeak("I would like to book a flight to Paris on Friday."), 1.0, 6.0)
    with browser.Page(PAGE, browser.write_mic_wav(tmp_path / "mic.wav", mic)) as page:
        page.connect()
        s = page.state()
        assert s["status"].startswith("connected"), (s["status"], s["errors"], page.console)
        assert s["rates"] == {"input": 16_000, "output": 24_000}  # from session.ready
        assert (s["microphone"]["sampleRate"], s["microphone"]["rate"]) == (16_000, 16_000)
        assert (s["player"]["sampleRate"], s["player"]["rate"]) == (24_000, 24_000)
        assert s["microphone"]["settings"]["echoCancellation"] is True
        # the voices the server named in session.ready, offered by the voice picker
        assert "default" in s["voices"], s.get("voices")
        options = page.page.eval_on_selector_all("#voice option", "os => os.map(o => o.value)")
        assert options[:len(s["voices"])] == s["voices"]

        # 1. A spoken turn, hands-free: its transcript.final shows on the page, its reply plays.
        spoken = page.wait_turn_done(1, timeout_s=60)
        assert spoken["interrupted"] is False
        assert spoken["finalText"].strip()
        # textContent: the text the page wrote (innerText collapses the runs of spaces a random-weight transcript has)
        assert page.page.text_content("#user-1").strip() == spoken["finalText"].strip()
        assert "partial" not in page.page.get_attribute("#user-1", "class")
        assert page.page.inner_text("#bot-1").strip()
        assert spoken["chunks"] > 0 and spoken["firstChunkMs"] is not None
        page.wait("g.started.some(x => x.turn === 1)")
        page.wait_played(SECOND)  # the worklet's played-sample counter advances
        s = page.state()
        assert isinstance(s["playback"]["underruns"], int)
        assert page.page.evaluate("() => !document.getElementById('speaker').paused")  # <audio> plays the stream
        # What the page shows live: the agent's state, the timeline, the record's timings, the log, the pickers.
        problems = live_view_problems(page, 1, {"speech.started", "transcript.final", "audio", "response.done"})
        assert not problems, "\n".join(problems)

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
        waited(page, "g.recordTurns[3]", 10)  # the screenshot shows the record's timings of turns 1 to 3
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


def sent_until_turn_end(page: browser.Page) -> tuple[list[int], dict]:
    """The sizes (samples) of the audio messages the page sent before its first turn.end, and that
    turn.end (its time)."""
    sent = page.page.evaluate("() => window.sent")
    end = next(i for i, m in enumerate(sent) if m["type"] == "turn.end")
    return [m["samples"] for m in sent[:end] if m["type"] == "audio"], sent[end]


def talk(page: browser.Page, frames: int) -> float:
    """Push-to-talk: press Talk, let `frames` microphone frames go, press it again; the time of
    the first press (performance.now(), ms)."""
    pressed = page.page.evaluate("() => performance.now()")
    page.page.click("#talk")
    page.wait(f"g.micFrames >= {frames}", 30)
    page.page.click("#talk")
    page.wait("g.talks.length === 1 && window.sent.some(m => m.type === 'turn.end')", 30)
    return pressed


def test_push_to_talk_sends_the_last_partial_frame(server, tmp_path: Path):
    """Every sample captured between the presses goes out before turn.end: whole 40 ms frames,
    then the rest of the last one (before: the rest was dropped)."""
    mic = speech.padded(speech.espeak("Hello, can you hear me?"), 0.5, 3.0)
    with browser.Page(f"{BASE}/?mode=manual&transport=websocket", browser.write_mic_wav(tmp_path / "mic.wav", mic)) as page:
        page.page.evaluate(RECORD_SENT)
        page.connect()
        assert page.state()["status"].startswith("connected"), page.state()
        assert page.state()["micFrames"] == 0  # push-to-talk: nothing goes before Talk
        talk(page, 30)
        audio, _ = sent_until_turn_end(page)
        s = page.state()
    captured = s["talks"][0]["captured"]
    assert sum(audio) == captured == s["talks"][0]["sent"], (audio, s["talks"])
    assert all(n == FRAME for n in audio[:-1]) and 0 < audio[-1] <= FRAME, audio
    assert audio[-1] == (captured % FRAME or FRAME)  # the partial frame is the last thing before turn.end
    assert s["errors"] == [], s["errors"]


def test_the_audio_runs_at_the_rates_session_ready_announces(server):
    """A server announcing other rates (session.ready rewritten on its way to the page) gets
    microphone frames at its input rate, and the replies are played at its output rate."""
    def rewrite_ready(ws):
        upstream = ws.connect_to_server()

        def to_page(frame):
            if isinstance(frame, bytes) and P.unpack(frame).get("type") == "session.ready":
                frame = P.pack(dict(P.unpack(frame), input_sample_rate=8_000, output_sample_rate=48_000))
            ws.send(frame)

        upstream.on_message(to_page)
        ws.on_message(upstream.send)

    with browser.Page(f"{BASE}/?mode=manual&transport=websocket") as page:
        page.page.route_web_socket("**/v1/conversation*", rewrite_ready)
        page.page.evaluate(RECORD_SENT)
        page.connect()
        s = page.state()
        assert s["status"].startswith("connected"), s
        assert s["rates"] == {"input": 8_000, "output": 48_000}
        assert (s["microphone"]["sampleRate"], s["microphone"]["rate"]) == (8_000, 8_000)
        assert (s["player"]["sampleRate"], s["player"]["rate"]) == (48_000, 48_000)
        talk(page, 5)
        audio, _ = sent_until_turn_end(page)
    assert all(n == 320 for n in audio[:-1]), audio  # 40 ms at 8 kHz


@pytest.mark.parametrize(("refused", "rate"), [("constructor", 24_000), ("microphone", 16_000)])
def test_a_browser_that_refuses_the_rate_is_told_so(server, refused: str, rate: int):
    """Where the browser will not run audio at the server's rates (REFUSES_THE_RATE), the page
    does not resample it: it says so once, with the rate and the browser's error, stays "not
    connected", and the session (hands-free, which would send from the start) gets no audio.
    The player starts first, so a refusing constructor is met at the 24 kHz output rate."""
    with browser.Page(f"{BASE}/?transport=websocket") as page:
        page.page.evaluate(REFUSES_THE_RATE[refused])
        page.page.evaluate(RECORD_SENT)
        page.connect()
        page.page.wait_for_timeout(1500)  # time for any audio to go
        s = page.state()
        shown = page.page.inner_text("#error")
        assert page.page.is_visible("#error")
        sent = page.page.evaluate("() => window.sent")
    told = f"this browser cannot run audio at {rate} Hz (NotSupportedError): try Chromium"
    assert s["errors"] == [{"code": "unsupported_sample_rate", "message": told}], s["errors"]
    assert shown.count(told) == 1, shown
    assert s["status"] == f"not connected: {told}", s["status"]
    assert s["rates"] == {"input": 16_000, "output": 24_000}  # the session was ready
    assert s["microphone"] is None and s["micFrames"] == 0
    assert not [m for m in sent if m["type"] == "audio"], sent
    assert not [c for c in page.console if c.startswith("pageerror")], page.console


def test_an_error_before_session_ready_is_shown_once(server):
    """A session option the server refuses: its bad_option error (instead of session.ready, then
    close 1008) is told once, and the page stays "not connected"."""
    with browser.Page(PAGE) as page:
        page.page.evaluate("""() => {
          const mode = document.getElementById('mode');
          mode.add(new Option('bogus', 'bogus'));
          mode.value = 'bogus';
        }""")
        page.connect()
        page.page.wait_for_timeout(1500)  # the server's close arrives after its error
        s = page.state()
        shown = page.page.inner_text("#error")
        assert page.page.is_visible("#error")
    assert [e["code"] for e in s["errors"]] == ["bad_option"], s["errors"]
    assert shown.count("bad_option") == 1, shown
    assert s["status"].startswith("not connected"), s["status"]
    assert s["messages"] == 0  # nothing before session.ready goes to the session's handlers


def test_a_refused_token_is_told_apart_from_a_missing_one(server):
    """POST /v1/session answers 401 unauthorized both without a token and with a wrong one (as a
    server with auth on does; this one has auth off, so the answer is the browser's route):
    without one the page asks for a token, with one it says the token was refused."""
    asked = []

    def refuse(route):
        asked.append(route.request.headers.get("authorization"))
        route.fulfill(status=401, headers={"WWW-Authenticate": "Bearer"}, content_type="application/json",
                      body=json.dumps({"type": "error", "code": "unauthorized",
                                       "message": "a valid Authorization: Bearer <token> header is required"}))

    with browser.Page(PAGE) as page:
        page.page.route("**/v1/session", refuse)
        page.connect()
        missing = page.state()
        assert page.page.is_visible("#token")
        page.connect(token="not-the-token-at-all")
        wrong = page.state()
        wrong_shown = page.page.inner_text("#error")
        assert page.page.is_visible("#token")
    assert asked == [None, "Bearer not-the-token-at-all"]
    assert missing["status"].startswith("not connected") and "needs a token" in missing["status"]
    assert wrong["status"].startswith("not connected") and "token was refused" in wrong["status"], wrong["status"]
    assert "needs a token" not in wrong["status"] and "token was refused" in wrong_shown
    assert [e["code"] for e in wrong["errors"]] == ["unauthorized", "unauthorized"]


def test_the_page_talks_over_webrtc_in_chromium(server, tmp_path: Path):
    """The page's default on localhost: WebRTC. A spoken turn from the fake microphone (through
    the browser's own echo canceller) gets its transcript and a reply the page receives as audio
    on the reply track (measured by the page's WebAudio meter, not only its text); then a typed
    turn over the data channel."""
    mic = speech.padded(speech.espeak("I would like to book a flight to Paris on Friday."), 1.0, 6.0)
    with browser.Page(f"{BASE}/", browser.write_mic_wav(tmp_path / "mic.wav", mic)) as page:
        page.connect()
        s = page.state()
        assert s["status"] == "connected (WebRTC)" and s["transport"] == "webrtc", (s["status"], page.console)
        spoken = page.wait_turn_done(1, timeout_s=60)
        assert spoken["finalText"].strip() and spoken["interrupted"] is False
        assert page.page.inner_text("#bot-1").strip()
        page.wait("g.rtc.loudWindows >= 25", 30)  # half a second of reply audio received
        s = page.state()
        assert spoken["firstChunkMs"] is not None  # (the tiny voice's loudness is its random weights': no level asserted)
        assert "response.output_audio.delta" not in s["rtc"]["events"]  # the audio came over the track
        waited(page, "g.agentState === 'listening'", 30)  # the reply has played out
        page.type_turn("Can you hear me?")
        typed = page.wait_turn_done(2)
        assert typed["finalText"] == "Can you hear me?" and page.page.inner_text("#bot-2").strip()
        problems = live_view_problems(page, 1, {"session.created", "input_audio_buffer.speech_started",
                                                "output_audio_buffer.started", "response.done"})
        waited(page, "g.recordTurns[2]", 10)  # the screenshot shows the record's timings of both turns
        page.screenshot(SCREENSHOT_WEBRTC)
        assert not problems, "\n".join(problems)
        assert not [c for c in page.console if c.startswith("pageerror")], page.console
