// Protocol v1 over one WebSocket (docs/protocol.md): msgpack maps in binary frames.
// Uses the vendored @msgpack/msgpack (window.MessagePack, web/vendor/msgpack.min.js).

const { encode, decode } = window.MessagePack;

// A ticket for the WebSocket handshake (browsers cannot send an Authorization header on it).
// With auth off the server still answers, and the ticket is simply not needed.
export async function fetchTicket(token) {
  const headers = token ? { Authorization: `Bearer ${token}` } : {};
  const r = await fetch("/v1/session", { method: "POST", headers });
  const body = await r.json().catch(() => ({}));
  if (!r.ok) {
    const err = new Error(body.message || `ticket request failed: HTTP ${r.status}`);
    err.code = body.code || `http_${r.status}`;
    throw err;
  }
  return body;
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
  // handlers: {onMessage(msg), onState(text), onClose(code, reason)}
  constructor(url, handlers) {
    this.url = url;
    this.handlers = handlers;
    this.ws = null;
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
        if (!ready && msg.type === "session.ready") {
          ready = true;
          resolve(msg);
        } else if (!ready && msg.type === "error") {
          reject(Object.assign(new Error(msg.message), { code: msg.code }));
        }
        this.handlers.onMessage(msg);
      };
      ws.onclose = (e) => {
        if (!ready) {
          // A handshake refused before the upgrade (401/403/429) shows only as a failed
          // connection: browsers hide the HTTP status from pages.
          reject(Object.assign(new Error(`the server refused the connection (close ${e.code})`), { code: "refused" }));
        }
        this.handlers.onClose(e.code, e.reason);
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
    if (this.ws) this.ws.close(1000, "bye");
  }
}
