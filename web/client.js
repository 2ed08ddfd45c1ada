// Protocol v1 over one WebSocket (docs/protocol.md): msgpack maps in binary frames.
// Uses the vendored @msgpack/msgpack (window.MessagePack, web/vendor/msgpack.min.js).

const { encode, decode } = window.MessagePack;

// A ticket for the WebSocket handshake (browsers cannot send an Authorization header on it).
// With auth off the server still answers, and the ticket is simply not needed. Refused, it
// throws an Error with the server's `code` and `message` and the HTTP `status` (a 401
// `unauthorized` answers both a missing and a wrong token: the caller knows which it sent).
export async function fetchTicket(token) {
  return postForJson("/v1/session", token, undefined, "ticket request");
}

// POST with the token as Bearer (if any); the answer's JSON, or an Error with the server's
// `code`, `message` and the HTTP `status`.
export async function postForJson(path, token, json, what) {
  const headers = token ? { Authorization: `Bearer ${token}` } : {};
  if (json !== undefined) headers["Content-Type"] = "application/json";
  const r = await fetch(path, { method: "POST", headers, body: json === undefined ? undefined : JSON.stringify(json) });
  const body = await r.json().catch(() => ({}));
  if (!r.ok) {
    const err = new Error(body.message || `${what} failed: HTTP ${r.status}`);
    err.code = body.code || `http_${r.status}`;
    err.status = r.status;
    throw err;
  }
  return body;
}

// The sample rates a session.ready announces: {input, output} in Hz (protocol v1 names them
// input_sample_rate and output_sample_rate; a server that left one out is taken at v1's rate).
export function sampleRates(ready) {
  const rate = (v, v1) => (Number.isFinite(v) && v > 0 ? v : v1);
  return { input: rate(ready.input_sample_rate, 16000), output: rate(ready.output_sample_rate, 24000) };
}

export function conversationUrl(ticket, options) {
  const url = new URL("/v1/conversation", window.location.href);
  url.protocol = url.protocol === "https:" ? "wss:" : "ws:";
  if (ticket) url.searchParams.set("ticket", ticket);
  for (const [k, v] of Object.entries(options)) url.searchParams.set(k, String(v));
  return url.toString();
}

// Per-turn numbers as this page saw them: times in ms from the end of the user's turn (the
// page sent text or turn.end, or, hands-free, the server's speech.stopped arrived).
export class TurnStats {
  constructor(turn, endedAt) {
    this.turn = turn;
    this.endedAt = endedAt;
    this.firstChunkMs = null; // first reply audio arrived
    this.firstPlayedMs = null; // first reply sample played (after the jitter buffer)
    this.largestGapMs = 0; // between reply audio arrivals
    this.chunks = 0;
    this.underruns = 0;
    this.interrupted = null;
    this.lastChunkAt = null;
  }

  onChunk(now) {
    if (this.firstChunkMs === null) this.firstChunkMs = now - this.endedAt;
    else this.largestGapMs = Math.max(this.largestGapMs, now - this.lastChunkAt);
    this.lastChunkAt = now;
    this.chunks++;
  }
}

// Close codes after which a session resumes by itself: the link dropped (1006, no close frame), or
// the server asked it to go on elsewhere (1012 after going_away, a draining gateway replica; 1001).
const RESUME_ON = [1001, 1006, 1011, 1012];
const BACKOFF_MS = [0, 100, 200, 500, 1000, 2000, 4000]; // before each attempt, then 4 s each
const sleep = (ms) => new Promise((r) => setTimeout(r, ms));

export class Conversation {
  // handlers: {onMessage(msg), onClose(code, reason), onDropped(code), onResumed(ready)}, from
  // session.ready on. Before it, how the connection went is told once, by open(): it resolves
  // with session.ready, or rejects with the server's error (code, message) or the refused
  // connection; neither goes to the handlers. onClose is not called for a close the page asked
  // for (close()). reconnectUrl(params), if given, makes the URL of a reconnection with the
  // resume parameters (a fresh ticket for it): a dropped session then resumes by itself, with
  // backoff, within its resume window (docs/protocol.md "Resume"): onDropped, then onResumed
  // (the messages go on) or, refused or out of time, onClose.
  constructor(url, handlers, reconnectUrl = null) {
    this.url = url;
    this.handlers = handlers;
    this.reconnectUrl = reconnectUrl;
    this.ws = null;
    this.closing = false;
    this.resumeToken = null;
    this.resumeWindowMs = 30000;
    this.lastAudio = null; // [turn, seq] of the last audio message received
    this.resumes = []; // {code, ms} of each resume
  }

  open() {
    return this._open(this.url);
  }

  _open(url) {
    return new Promise((resolve, reject) => {
      const ws = new WebSocket(url);
      ws.binaryType = "arraybuffer";
      this.ws = ws;
      let ready = false;
      ws.onmessage = (e) => {
        if (typeof e.data === "string") return; // the protocol is binary; ignore anything else
        const msg = decode(new Uint8Array(e.data));
        if (!ready) {
          if (msg.type === "session.ready") {
            ready = true;
            if (msg.resume_token) this.resumeToken = msg.resume_token;
            if (msg.resume_window_s) this.resumeWindowMs = 1000 * msg.resume_window_s;
            resolve(msg);
          } else if (msg.type === "error") {
            // Instead of session.ready (bad_option, server_busy, resume_refused); the server closes next.
            reject(Object.assign(new Error(msg.message), { code: msg.code }));
          }
          return;
        }
        if (msg.type === "going_away" && msg.resume_token) this.resumeToken = msg.resume_token;
        if (msg.type === "audio") this.lastAudio = [msg.turn, msg.seq];
        this.handlers.onMessage(msg);
      };
      ws.onclose = (e) => {
        if (!ready) {
          // A handshake refused before the upgrade (401/403/429) shows only as a failed
          // connection: browsers hide the HTTP status from pages. (After an error message,
          // the promise is settled already and this changes nothing.)
          reject(Object.assign(new Error(`the server refused the connection (close ${e.code})`), { code: "refused" }));
          return;
        }
        if (this.closing || ws !== this.ws) return;
        if (this.reconnectUrl && this.resumeToken && RESUME_ON.includes(e.code)) this._resume(e.code);
        else this.handlers.onClose(e.code, e.reason);
      };
    });
  }

  async _resume(code) {
    const started = performance.now();
    if (this.handlers.onDropped) this.handlers.onDropped(code);
    for (let attempt = 0; performance.now() - started < this.resumeWindowMs && !this.closing; attempt++) {
      await sleep(BACKOFF_MS[Math.min(attempt, BACKOFF_MS.length - 1)]);
      const params = { resume: this.resumeToken };
      if (this.lastAudio) [params.resume_turn, params.resume_seq] = this.lastAudio;
      try {
        const ready = await this._open(await this.reconnectUrl(params));
        this.resumes.push({ code, ms: performance.now() - started });
        if (this.handlers.onResumed) this.handlers.onResumed(ready);
        return;
      } catch (err) {
        if (err.code === "resume_refused") break; // the session is gone: no use trying again
      }
    }
    if (!this.closing) this.handlers.onClose(code, "the session could not be resumed");
  }

  get isOpen() {
    return this.ws && this.ws.readyState === WebSocket.OPEN;
  }

  send(msg) {
    if (this.isOpen) this.ws.send(encode(msg));
  }

  audio(int16Buffer) {
    this.send({ type: "audio", pcm: new Uint8Array(int16Buffer) });
  }

  text(text) {
    this.send({ type: "text", text });
  }

  turnEnd() {
    this.send({ type: "turn.end" });
  }

  close() {
    this.closing = true;
    if (this.ws) this.ws.close(1000, "bye");
  }
}
