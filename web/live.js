// The call, live: the agent's state, the timeline, the event log and the server's record, fed by
// what web/app.js receives (protocol v1 messages, Realtime events on WebRTC, the playback worklet)
// and sends. Everything it shows is in window.gapless: agentState and agentStates, timeline, log,
// record and recordTurns.
import { EventLog, summariseRealtime, summariseV1 } from "./eventlog.js";
import { RecordPoller, turnFigures } from "./record.js";
import { Timeline } from "./timeline.js";

export const STATES = ["listening", "hearing you", "thinking", "speaking"];
const MAX_STATES = 200;
const SETTLE_MS = 4000; // speech stopped and no turn came of it (noise, a pause): back to listening
const QUIET_MS = 300; // WebRTC: the reply track this quiet after response.done: the reply has played out
const DRAIN_MS = 2000; // ... but no longer than this after it
const REDRAW_MS = 250;

export class Live {
  // els: {agent, timeline, log}; hooks: {responseTurn(id) (WebRTC: the page's turn of a
  // response, or undefined), rtcTurn() (WebRTC: the page's last turn), onRecordTurns(turns)}
  constructor(state, els, hooks) {
    Object.assign(this, { state, els, hooks });
    Object.assign(state, { agentState: "off", agentStates: [], log: [], timeline: {}, record: null, recordTurns: {},
                           recordErrors: 0 });
    this.log = new EventLog(els.log, state.log);
    this.timeline = new Timeline(els.timeline, state.timeline);
    this.poller = null;
    this.timer = null;
    this.lastTurn = 0; // v1: the newest turn with a transcript.final
    this.pending = false; // the page ended a turn (text, turn.end, commit) not yet answered
    this.latestResponse = null; // WebRTC
    this.draining = null; // WebRTC: {id, since}: response.done came, the track may still play
    this.loudAt = -Infinity; // WebRTC: when the reply track was last loud
    this.settle = null;
    this.setAgent("off");
    this.timeline.draw(performance.now());
  }

  start(transport, token) {
    this.stop();
    const t0 = performance.now();
    this.transport = transport;
    this.state.agentStates.length = 0;
    Object.assign(this.state, { record: null, recordTurns: {}, recordErrors: 0 });
    this.log.reset(t0);
    this.timeline.reset(t0);
    this.lastTurn = 0;
    this.pending = false;
    this.latestResponse = this.draining = null;
    let lastError = null;
    this.poller = new RecordPoller(token, (rec) => { lastError = null; this.onRecord(rec); }, (err) => {
      this.state.recordErrors++;
      if (err.code !== lastError) this.log.add("record", `fetch failed: ${err.code} (${err.message.slice(0, 60)})`);
      lastError = err.code;
    });
    this.timer = setInterval(() => this.tick(), REDRAW_MS);
    this.log.add("connect", transport);
  }

  connected(sessionId) {
    if (sessionId) this.poller.start(sessionId);
    this.setAgent("listening");
  }

  stop(why) {
    if (!this.poller) return;
    this.poller.stop();
    this.poller = null;
    clearInterval(this.timer);
    clearTimeout(this.settle);
    const now = performance.now();
    this.timeline.stop(now);
    this.timeline.draw(now);
    if (why) this.log.add("disconnect", why);
    this.setAgent("off");
  }

  setAgent(agent, turn = null) {
    const s = this.state;
    if (agent === s.agentState) return;
    s.agentState = agent;
    if (agent !== "off" || s.agentStates.length) {
      s.agentStates.push({ state: agent, t: Math.round(performance.now() - this.timeline.t0) / 1000, turn });
      if (s.agentStates.length > MAX_STATES) s.agentStates.splice(0, s.agentStates.length - MAX_STATES);
    }
    this.els.agent.textContent = agent === "off" ? "not in a call" : agent;
    this.els.agent.className = `agent ${agent.replace(" ", "-")}`;
  }

  // speech began: the turn being taken is the one after the last (v1's numbers; WebRTC's, the page's)
  heard(now) {
    clearTimeout(this.settle);
    this.timeline.speechStart(now);
    this.setAgent("hearing you", this.nextTurn());
  }

  stopped(now, agent) {
    this.timeline.speechStop(now);
    if (agent) this.setAgent(agent, this.nextTurn());
    clearTimeout(this.settle);
    const n = this.state.agentStates.length;
    this.settle = setTimeout(() => {
      if (this.state.agentStates.length === n && ["hearing you", "thinking"].includes(this.state.agentState) && !this.pending) {
        this.setAgent(this.timeline.last("reply", (s) => s.end === null) ? "speaking" : "listening");
      }
    }, SETTLE_MS);
  }

  nextTurn() {
    return (this.transport === "webrtc" ? this.hooks.rtcTurn() : this.lastTurn) + 1;
  }

  // The page sent something: a typed turn, turn.end, a commit, session.update, ...
  sent(type, summary = "", endsTurn = false) {
    this.log.add(`sent ${type}`, summary);
    if (!endsTurn) return;
    this.pending = true;
    clearTimeout(this.settle);
    this.setAgent("thinking", this.transport === "webrtc" ? this.hooks.rtcTurn() : this.lastTurn + 1);
  }

  v1(msg, now) {
    const summary = summariseV1(msg);
    if (summary !== null) this.log.add(msg.type, summary);
    switch (msg.type) {
      case "speech.started": this.heard(now); break;
      case "speech.stopped": this.stopped(now, null); break;
      case "transcript.final":
        clearTimeout(this.settle);
        this.lastTurn = Math.max(this.lastTurn, msg.turn);
        this.pending = false;
        this.setAgent("thinking", msg.turn);
        break;
      case "audio":
        if (msg.seq === 0 || !this.timeline.last("reply", (s) => s.key === msg.turn)) {
          this.timeline.replyStart(msg.turn, msg.turn, now);
          if (msg.turn >= this.lastTurn) this.setAgent("speaking", msg.turn);
        }
        break;
      case "response.resumed": this.setAgent("speaking", msg.turn); break;
      case "response.done":
        this.timeline.replyEnd(msg.turn, now);
        if (msg.turn >= this.lastTurn && !this.pending && ["thinking", "speaking"].includes(this.state.agentState)) {
          this.setAgent("listening", msg.turn);
        }
        if (this.poller) this.poller.fetch();
        break;
    }
  }

  realtime(ev, now) {
    const summary = summariseRealtime(ev);
    if (summary !== null) this.log.add(ev.type, summary);
    const turnOf = (id) => this.hooks.responseTurn(id) ?? this.hooks.rtcTurn();
    switch (ev.type) {
      case "session.created": if (this.poller) this.poller.start(ev.session.id); break;
      case "input_audio_buffer.speech_started": this.endDrain(now); this.heard(now); break;
      case "input_audio_buffer.speech_stopped": this.stopped(now, "thinking"); break;
      case "input_audio_buffer.committed": clearTimeout(this.settle); this.setAgent("thinking", this.nextTurn()); break;
      case "response.created":
        this.endDrain(now);
        this.latestResponse = ev.response.id;
        this.pending = false;
        break;
      case "output_audio_buffer.started":
        this.timeline.replyStart(ev.response_id, turnOf(ev.response_id), now);
        if (ev.response_id === this.latestResponse) this.setAgent("speaking", turnOf(ev.response_id));
        break;
      case "output_audio_buffer.stopped":
      case "output_audio_buffer.cleared":
        this.replyOver(ev.response_id, now);
        break;
      case "response.done": {
        const id = ev.response.id;
        // The track plays out what the server sent ahead: the reply ends where it goes quiet.
        if (now - this.loudAt < QUIET_MS && this.timeline.last("reply", (s) => s.key === id && s.end === null)) {
          this.draining = { id, since: now };
        } else {
          this.replyOver(id, now);
        }
        if (this.poller) this.poller.fetch();
        break;
      }
    }
  }

  replyOver(id, now) {
    if (this.draining && this.draining.id === id) this.draining = null;
    this.timeline.replyEnd(id, now);
    if (id === this.latestResponse && !this.pending && ["thinking", "speaking"].includes(this.state.agentState)) {
      this.setAgent("listening", this.hooks.responseTurn(id) ?? this.hooks.rtcTurn());
    }
  }

  endDrain(now) {
    if (this.draining) this.replyOver(this.draining.id, now);
  }

  // WebRTC: the reply track's loudness (web/webrtc.js TrackMeter), every 20 ms
  loudness(loud, now) {
    if (loud) this.loudAt = now;
    if (this.draining && (now - this.loudAt >= QUIET_MS || now - this.draining.since >= DRAIN_MS)) this.endDrain(now);
  }

  // The playback worklet (protocol v1): underruns are the page's own gaps
  playback(ev, now) {
    if (ev.type === "underrun") {
      this.timeline.underrun(ev.turn, now);
      this.log.add("underrun", `turn ${ev.turn}: the playback buffer ran dry`);
    } else if (ev.type === "rebuffered" || ev.type === "flushed") {
      this.timeline.rebuffered(now);
    }
  }

  onRecord(record) {
    const pageTurn = (turn, reply) => (this.transport === "webrtc" && reply ? this.hooks.responseTurn(reply.id) : turn);
    const { turns, gaps } = turnFigures(record, pageTurn);
    Object.assign(this.state, { record, recordTurns: turns });
    this.timeline.setServerGaps(gaps);
    this.hooks.onRecordTurns(turns);
  }

  tick() {
    if (this.draining) this.loudness(false, performance.now());
    this.timeline.draw(performance.now());
  }
}
