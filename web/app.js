// The page: connects, streams the microphone, plays the reply, shows what happens.
// window.gapless holds what the page measured (the browser test and load/browser_talk.py read it).
import { Microphone, Player } from "./audio.js";
import { Conversation, TurnStats, conversationUrl, fetchTicket, sampleRates } from "./client.js";
import { RealtimeCall, TrackMeter, fetchCallKey } from "./webrtc.js";
import { Live } from "./live.js";
import { renderTurn as renderRow } from "./turns.js";
import { DevicePickers } from "./devices.js";
import { AgentControls } from "./controls.js";

const $ = (id) => document.getElementById(id);
const params = new URLSearchParams(window.location.search);
if (params.has("jitter_ms")) $("jitter").value = params.get("jitter_ms");
if (params.has("mode")) $("mode").value = params.get("mode");
// WebRTC where the browser offers it in a secure context (https, or localhost): the browser's own
// echo canceller and jitter buffer. ?transport=websocket keeps protocol v1 over a WebSocket.
const rtcPossible = window.isSecureContext && "RTCPeerConnection" in window;
$("transport").value = params.get("transport") || (rtcPossible ? "webrtc" : "websocket");
$("token").value = sessionStorage.getItem("gapless-token") || "";
$("token-row").hidden = !$("token").value;

const state = {
  status: "not connected",
  turns: {}, // turn -> TurnStats
  playback: { played: 0, buffered: 0, underruns: 0, overflowed: 0 },
  flushes: [], // {turn, dropped, played}: an interrupted reply's buffered samples, dropped unplayed
  pauses: [], // {turn, resumed}: replies the server paused (response.paused), and whether they resumed
  started: [], // {turn, played}: each turn's first sample, with the samples played before it
  errors: [], // {code, message}: each error once
  rates: null, // {input, output}: the sample rates session.ready announced (Hz)
  microphone: null, // {label, settings, sampleRate (the capture context's), rate (sent at)}
  player: null, // {sampleRate (the playback context's), rate (the replies')}
  talks: [], // push-to-talk turns: {captured, sent} samples (at rates.input), sent before turn.end
  micFrames: 0,
  messages: 0,
  drops: [], // {code}: each time the connection was lost (it then resumes by itself)
  resumed: 0, // sessions resumed after a drop (docs/protocol.md "Resume")
  transport: null, // "webrtc" or "websocket", once connected
  // WebRTC: the reply track as received (RMS of 20 ms windows), and each response's status
  rtc: { windows: 0, loudWindows: 0, peak: 0, responses: [], events: [] },
  devices: {}, // {microphones, speakers: [{deviceId, label}], canChooseSpeaker, speaker} (web/devices.js)
  settings: null, // the agent settings last sent (web/controls.js)
};
window.gapless = state;

let conv = null, mic = null, player = null;
let call = null, meter = null; // WebRTC
let rtcTurn = 0; // WebRTC: the turns this page numbered (a transcript or a typed message each)
const turnOfResponse = {}; // WebRTC: response id -> the turn it answers
let pendingEnd = null; // when the page ended the user's turn (text sent, turn.end sent)
let lastSpeechStopped = null; // hands-free: when the server said the speech stopped
let flushedTurn = -1; // audio of this turn (interrupted) is not played
// The live views (web/live.js): agentState(s), timeline, log, record and recordTurns in window.gapless.
const live = new Live(state, { agent: $("agent-state"), timeline: $("timeline"), log: $("events") }, {
  responseTurn: (id) => turnOfResponse[id], rtcTurn: () => rtcTurn,
  onRecordTurns: (turns) => Object.keys(turns).forEach((t) => renderTurn(Number(t))),
});
const devices = new DevicePickers($("mic"), $("speaker-out"), $("speaker-note"), $("speaker"), state.devices, (id) => {
  const switched = mic ? mic.switchTo(id) : call ? call.switchMicrophone(id) : null;
  if (switched) switched.then(() => live.log.add("microphone", id || "default"), (e) => showError(e.name, e.message));
});
// Apply sends the settings over the call there is (web/controls.js); the event log shows them.
const controls = new AgentControls({ instructions: $("instructions"), voice: $("voice"), voiceOther: $("voice-other"),
                                     tools: $("tools"), apply: $("apply"), error: $("tools-error") }, state,
                                   () => [conv, call], (type, summary) => live.log.add(type, summary));

function setStatus(text, cls = "") {
  state.status = text;
  $("state").textContent = text;
  $("state").className = cls;
}

function showError(code, message) {
  state.errors.push({ code, message });
  $("error").hidden = false;
  $("error").textContent = `${code}: ${message}`;
}

function line(turn, who) {
  const id = `${who}-${turn}`;
  let el = document.getElementById(id);
  if (!el) {
    el = document.createElement("p");
    el.id = id;
    el.className = `line ${who}`;
    $("conversation").appendChild(el);
  }
  return el;
}

// A turn's row of the table (web/turns.js): this page's figures, then the server's record.
const renderTurn = (s, turn = s.turn ?? s) => renderRow($("turns").tBodies[0], turn, state.turns[turn], state.recordTurns[turn]);

function onPlayback(ev) {
  live.playback(ev, performance.now());
  if (ev.type === "stats") {
    // Counts in reply samples, at the server's output rate (ev.rate).
    state.playback = { played: ev.played, buffered: ev.buffered, underruns: ev.underruns, overflowed: ev.overflowed };
    $("playback").textContent = `played ${(ev.played / ev.rate).toFixed(1)} s · buffered ${Math.round((ev.buffered * 1000) / ev.rate)} ms` +
      ` · underruns ${ev.underruns}`;
  } else if (ev.type === "started") {
    state.started.push({ turn: ev.turn, played: ev.played });
    const s = state.turns[ev.turn];
    if (s && s.firstPlayedMs === null) { s.firstPlayedMs = performance.now() - s.endedAt; renderTurn(s); }
  } else if (ev.type === "underrun") {
    const s = state.turns[ev.turn];
    if (s) { s.underruns++; renderTurn(s); }
  } else if (ev.type === "flushed") {
    state.flushes.push({ turn: flushedTurn, dropped: ev.dropped, played: ev.played });
  }
}

function onMessage(msg) {
  state.messages++;
  const now = performance.now();
  live.v1(msg, now);
  switch (msg.type) {
    case "speech.started":
      setStatus("hearing you…", "connected");
      break;
    case "speech.stopped":
      lastSpeechStopped = now;
      setStatus("connected", "connected");
      break;
    case "transcript.partial": {
      const el = line(msg.turn, "user");
      el.textContent = msg.text;
      el.classList.add("partial");
      break;
    }
    case "transcript.final": {
      const el = line(msg.turn, "user");
      el.textContent = msg.text;
      el.classList.remove("partial");
      const endedAt = pendingEnd ?? lastSpeechStopped ?? now;
      pendingEnd = lastSpeechStopped = null;
      state.turns[msg.turn] = Object.assign(new TurnStats(msg.turn, endedAt), { finalText: msg.text, finalAt: now });
      renderTurn(state.turns[msg.turn]);
      break;
    }
    case "response.text":
      line(msg.turn, "bot").textContent += msg.text;
      break;
    case "audio": {
      if (!player || msg.turn === flushedTurn) break;
      player.chunk(msg.pcm, msg.turn);
      const s = state.turns[msg.turn];
      if (s) { s.onChunk(now); renderTurn(s); }
      break;
    }
    case "response.paused":
      if (player) player.hold();
      state.pauses.push({ turn: msg.turn, resumed: false });
      break;
    case "response.resumed":
      if (player) player.release();
      if (state.pauses.length) state.pauses[state.pauses.length - 1].resumed = true;
      break;
    case "response.done": {
      const s = state.turns[msg.turn];
      if (msg.interrupted) {
        flushedTurn = msg.turn;
        if (player) player.flush();
        line(msg.turn, "bot").classList.add("interrupted");
      } else if (player) {
        player.end(msg.turn);
      }
      if (s) { s.interrupted = msg.interrupted; s.doneAt = now; renderTurn(s); }
      break;
    }
    case "error":
      showError(msg.code, msg.message);
      break;
  }
}

// POST /v1/session; a 401 says whether the server wants a token or refused the one given.
async function ticketFor(token) {
  try {
    return await fetchTicket(token);
  } catch (err) {
    if (err.status !== 401 && err.code !== "unauthorized") throw err;
    $("token-row").hidden = false;
    if (!token) {
      throw Object.assign(new Error("this server needs a token: enter it and connect again"), { code: err.code });
    }
    sessionStorage.removeItem("gapless-token");
    throw Object.assign(new Error("the token was refused: check it and connect again"), { code: err.code });
  }
}

async function connect() {
  $("connect").disabled = true;
  $("error").hidden = true;
  const mode = $("mode").value;
  const token = $("token").value.trim();
  live.start($("transport").value, token);
  if ($("transport").value === "webrtc") return connectCall(mode, token);
  state.transport = "websocket";
  try {
    const agent = controls.read(false); // the agent's settings; tools that are not JSON: told now, nothing sent
    setStatus("asking for a ticket…");
    const ticket = await ticketFor(token);
    if (token) sessionStorage.setItem("gapless-token", token);
    setStatus("opening the microphone…");
    mic = new Microphone((pcm) => { state.micFrames++; conv && conv.audio(pcm); }, devices.microphone);
    await mic.open();
    devices.refresh(); // the labels, now that the page may use the microphone
    setStatus("connecting…");
    const options = { turn_detection: mode };
    if (params.get("server_echo_cancellation") === "false") options.echo_cancellation = false;
    // ?resume_false_interruption=true: a "mm-hm" over the reply pauses it, and it plays on after.
    if (params.has("resume_false_interruption")) options.resume_false_interruption = params.get("resume_false_interruption");
    // A dropped session resumes by itself (docs/protocol.md "Resume"), each try with a fresh ticket.
    const reconnectUrl = async (resume) => conversationUrl((await fetchTicket(token)).ticket, { ...options, ...resume });
    conv = new Conversation(conversationUrl(ticket.ticket, options), { onMessage, onClose, onDropped, onResumed },
                            reconnectUrl);
    const ready = await conv.open();
    controls.offer(ready.voices); // the voices this server has (a v1 extension)
    if (Object.keys(agent).length) controls.send(agent, conv, null);
    // The audio runs at the rates this server announced: the microphone is sent at its input
    // rate, replies are played at its output rate (web/audio.js). A browser that cannot run
    // audio at them fails here, before any audio is sent.
    state.rates = sampleRates(ready);
    setStatus("starting audio…");
    player = new Player($("speaker"), Number($("jitter").value), onPlayback);
    state.player = await player.start(state.rates.output);
    state.microphone = await mic.start(state.rates.input, mode === "vad");
    connected(`connected (session ${String(ready.session_id).slice(0, 8)})`, mode, ready.session_id);
  } catch (err) {
    // Told once: the server's error before session.ready, a refused ticket or connection, or
    // the microphone or audio failing, each reaches here and nowhere else.
    await notConnected(err);
  }
}

function connected(status, mode, sessionId) {
  setStatus(status, "connected");
  live.connected(sessionId);
  $("connect").textContent = "Disconnect";
  $("connect").disabled = $("apply").disabled = false;
  $("talk").disabled = mode !== "manual";
  $("text").disabled = $("send").disabled = false;
}

async function notConnected(err) {
  setStatus(`not connected: ${err.message}`, "failed");
  showError(err.code || err.name, err.message);
  await teardown();
  $("connect").disabled = false;
}

// ------------------------------------------------------------------ WebRTC (web/webrtc.js)
const LOUD_RMS = 0.01;

function onWindow(rms) {
  live.loudness(rms > LOUD_RMS, performance.now());
  const r = state.rtc;
  r.windows++;
  r.peak = Math.max(r.peak, rms);
  if (rms <= LOUD_RMS) return;
  r.loudWindows++;
  const s = state.turns[rtcTurn];
  if (s && s.firstChunkMs !== null && s.firstPlayedMs === null) { s.firstPlayedMs = performance.now() - s.endedAt; renderTurn(s); }
}

function rtcUserTurn(text, endedAt) {
  rtcTurn++;
  line(rtcTurn, "user").textContent = text;
  state.turns[rtcTurn] = Object.assign(new TurnStats(rtcTurn, endedAt), { finalText: text, finalAt: performance.now() });
  renderTurn(state.turns[rtcTurn]);
}

function onRealtimeEvent(ev) {
  state.messages++;
  state.rtc.events.push(ev.type);
  const now = performance.now();
  const turnOf = (id) => turnOfResponse[id] ?? rtcTurn;
  switch (ev.type) {
    case "input_audio_buffer.speech_started":
      setStatus("hearing you…", "connected");
      break;
    case "input_audio_buffer.speech_stopped":
      lastSpeechStopped = now;
      setStatus("connected (WebRTC)", "connected");
      break;
    case "conversation.item.input_audio_transcription.completed":
      rtcUserTurn(ev.transcript, pendingEnd ?? lastSpeechStopped ?? now);
      pendingEnd = lastSpeechStopped = null;
      break;
    case "response.created":
      turnOfResponse[ev.response.id] = rtcTurn;
      break;
    case "response.output_audio_transcript.delta":
    case "response.output_text.delta":
      line(turnOf(ev.response_id), "bot").textContent += ev.delta;
      break;
    case "output_audio_buffer.started": {
      const s = state.turns[turnOf(ev.response_id)];
      if (s) { s.onChunk(now); renderTurn(s); }
      break;
    }
    case "response.done": {
      const t = turnOf(ev.response.id);
      const cut = ev.response.status === "cancelled";
      state.rtc.responses.push(ev.response.status);
      if (cut) line(t, "bot").classList.add("interrupted");
      const s = state.turns[t];
      if (s) { s.interrupted = cut; s.doneAt = now; renderTurn(s); }
      break;
    }
    case "error":
      showError(ev.error.code, ev.error.message);
      break;
  }
  live.realtime(ev, now);
}

async function connectCall(mode, token) {
  state.transport = "webrtc";
  try {
    const agent = controls.read(false);
    setStatus("asking for a call key…");
    let key;
    try {
      key = await fetchCallKey(token);
    } catch (err) {
      if (err.status === 401) $("token-row").hidden = false;
      throw err;
    }
    if (token) sessionStorage.setItem("gapless-token", token);
    setStatus("calling…");
    call = new RealtimeCall({
      onEvent: onRealtimeEvent,
      onTrack: (stream) => {
        $("speaker").srcObject = stream;
        meter = new TrackMeter(stream, onWindow);
      },
      onClose: (why) => { if (call) { setStatus(`disconnected (${why})`); teardown(); } },
    });
    const detection = mode === "vad" ? { type: "semantic_vad" } : null;
    const session = controls.realtimeSession(agent); // instructions, voice, tools: in the call's own session
    session.audio = { ...session.audio, input: { turn_detection: detection } };
    await call.open(key, session, devices.microphone);
    if (Object.keys(agent).length) controls.sent(agent);
    devices.refresh();
    connected("connected (WebRTC)", mode);
  } catch (err) {
    await notConnected(err);
  }
}

function onDropped(code) {
  state.drops.push({ code });
  live.log.add("dropped", `close ${code}: resuming`);
  setStatus(`connection lost (close ${code}): resuming…`, "failed");
}

function onResumed(ready) {
  state.resumed++;
  live.log.add("resumed", `session ${ready.session_id}`);
  setStatus(`connected (session ${String(ready.session_id).slice(0, 8)}, resumed)`, "connected");
}

function onClose(code, reason) {
  setStatus(`disconnected (close ${code}${reason ? ": " + reason : ""})`, code === 1000 ? "" : "failed");
  teardown();
}

async function teardown(why = state.status) {
  const [c, m, p, rc, mt] = [conv, mic, player, call, meter];
  conv = mic = player = call = meter = null;
  live.stop(why);
  if (rc) rc.close();
  if (mt) mt.stop();
  if (c) c.close();
  if (m) await m.stop();
  if (p) await p.stop();
  $("connect").textContent = "Connect";
  $("talk").disabled = $("text").disabled = $("send").disabled = $("apply").disabled = true;
  $("talk").setAttribute("aria-pressed", "false");
}

$("connect").addEventListener("click", () => (conv || call ? teardown("Disconnect").then(() => setStatus("not connected")) : connect()));

// Push-to-talk: the first press starts the turn, the second ends it: what the microphone
// captured up to then goes out, its last partial frame included, and then turn.end.
$("talk").addEventListener("click", async () => {
  if (call) return talkOverCall();
  if (!conv || !mic) return;
  const talking = $("talk").getAttribute("aria-pressed") === "true";
  if (!talking) {
    mic.startSending();
    $("talk").setAttribute("aria-pressed", "true");
    $("talk").textContent = "Done";
  } else {
    $("talk").disabled = true;
    const c = conv;
    const talk = await mic.stopSending();
    state.talks.push(talk);
    c.turnEnd();
    pendingEnd = performance.now();
    live.sent("turn.end", "", true);
    $("talk").setAttribute("aria-pressed", "false");
    $("talk").textContent = "Talk";
    $("talk").disabled = conv !== c;
  }
});

// WebRTC push-to-talk: the microphone always streams; the first press drops what it sent so far,
// the second commits the turn and asks for the reply.
function talkOverCall() {
  const talking = $("talk").getAttribute("aria-pressed") === "true";
  if (!talking) {
    call.send({ type: "input_audio_buffer.clear" });
    live.sent("input_audio_buffer.clear");
  } else {
    call.send({ type: "input_audio_buffer.commit" });
    call.send({ type: "response.create" });
    pendingEnd = performance.now();
    live.sent("input_audio_buffer.commit", "and response.create", true);
  }
  $("talk").setAttribute("aria-pressed", String(!talking));
  $("talk").textContent = talking ? "Talk" : "Done";
}

$("typed").addEventListener("submit", (e) => {
  e.preventDefault();
  const text = $("text").value.trim();
  if (text && call) {
    call.send({ type: "conversation.item.create", item: { type: "message", role: "user",
                                                          content: [{ type: "input_text", text }] } });
    call.send({ type: "response.create" });
    rtcUserTurn(text, performance.now());
    live.sent("conversation.item.create", `"${text.slice(0, 60)}" and response.create`, true);
    $("text").value = "";
    return;
  }
  if (!text || !conv) return;
  conv.text(text);
  pendingEnd = performance.now();
  live.sent("text", `"${text.slice(0, 60)}"`, true);
  $("text").value = "";
});

$("jitter").addEventListener("change", () => {
  if (player && player.node) player.node.port.postMessage({ type: "jitter", ms: Number($("jitter").value) });
});
