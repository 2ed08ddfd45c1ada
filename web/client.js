// Protocol v1 over one WebSocket (docs/protocol.md): msgpack maps in binary frames.
// Uses the vendored @msgpack/msgpack (window.MessagePack, web/vendor/msgpack.min.js).

const { encode, decode } = window.MessagePack;

// A ticket for the WebSocket handshake (browsers cannot send an Authorization header on it).
// With auth off the server still answers, and the ticket is simply not needed. Refused, it
// throws an Error with the server's `code` and `message` and the HTTP `status` (a 401
// `unauthorized` answers both a missing and a wrong token: the caller knows which it sent).
export async function fetchTicket(token) {
  const headers = token ? { Authorization: `Bearer ${token}` } : {};
  const r = await fetch("/v1/session", { method: "POST", headers });
  const body = await r.json().catch(() => ({}));
  if (!r.ok) {
    const err = new Error(body.message || `ticket request failed: HTTP ${r.status}`);
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

export class Conversation {
  // handlers: {onMessage(msg), onClose(code, reason)}, from session.ready on. Before it, how
  // the connection went is told once, by open(): it resolves with session.ready, or rejects with
  // the server's error (code, message) or the refused connection; neither goes to the handlers.
  // onClose is not called for a close the page asked for (close()).
  constructor(url, handlers) {
    this.url = url;
    this.handlers = handlers;
    this.ws = null;
    this.closing = false;
  }

  open() {
    return new Promise((resolve, reject) => {
      const ws = new WebSocket(this.url);
      ws.binaryType = "arraybuffer";
      this.ws = ws;
      let ready = false;
      ws.onmessage = (e) => {
        if (typeof e.data === "string") return; // the protocol is binary; ignore anything else
        const msg = decode(new Uint8Array(e.data));
        if (!ready) {
          if (msg.type === "session.ready") {
            ready = true;
            resolve(msg);
          } else if (msg.type === "error") {
            // Instead of session.ready (bad_option, server_busy); the server closes next.
            reject(Object.assign(new Error(msg.message), { code: msg.code }));
          }
          return;
        }
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
        if (!this.closing) this.handlers.onClose(e.code, e.reason);
      };
    });
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
