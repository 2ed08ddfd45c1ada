// The server's record of this call (docs/observability.md, "The record of a call"):
// GET /v1/sessions/{session_id}/record, with the token the session was opened with (if any).
// The server puts it at most every 2 s while it changed, and at the connection's end; before the
// first put it answers 404 record_not_found.
export const POLL_MS = 2000;

export class RecordPoller {
  // onRecord(record) for each record fetched; onError(err) for each failed fetch (err.code).
  constructor(token, onRecord, onError) {
    this.token = token;
    this.onRecord = onRecord;
    this.onError = onError;
    this.id = null;
    this.timer = null;
    this.inFlight = false; // one fetch at a time
    this.again = false; // asked for while one was in flight: one more after it
    this.stopped = false;
  }

  start(sessionId) {
    if (this.stopped || this.id === sessionId) return;
    this.id = sessionId;
    clearInterval(this.timer);
    this.timer = setInterval(() => this.fetch(), POLL_MS);
    this.fetch();
  }

  async fetch() {
    if (this.stopped || !this.id) return;
    if (this.inFlight) {
      this.again = true;
      return;
    }
    this.inFlight = true;
    try {
      const r = await fetch(`/v1/sessions/${encodeURIComponent(this.id)}/record`, {
        headers: this.token ? { Authorization: `Bearer ${this.token}` } : {}, cache: "no-store",
      });
      const body = await r.json().catch(() => ({}));
      if (!r.ok) throw Object.assign(new Error(body.error?.message || `HTTP ${r.status}`), { code: body.error?.code || `http_${r.status}` });
      if (!this.stopped) this.onRecord(body);
    } catch (err) {
      if (!this.stopped) this.onError(err);
    } finally {
      this.inFlight = false;
      if (this.again && !this.stopped) {
        this.again = false;
        this.fetch();
      }
    }
  }

  stop() {
    this.stopped = true;
    clearInterval(this.timer);
  }
}

// What the turns table shows of the record, per turn of the page: pageTurn(recordTurn, reply)
// says which (v1: the record's own turn; WebRTC: the page numbers its turns, and a reply's id is
// its response's, so a typed message's reply, which the server counts in the turn before, finds
// its own). Its figures: the turn's first reply that sent audio (else its first), ms as the
// record has them; dead air: every reply's gaps, by cause.
export function turnFigures(record, pageTurn) {
  const out = {};
  const gaps = [];
  for (const t of record.turns || []) {
    const replies = t.replies || [];
    if (!replies.length && t.stt_final_ms == null) continue;
    (replies.length ? replies : [null]).forEach((reply, i) => {
      const turn = (reply && pageTurn(t.turn, reply)) ?? t.turn;
      const f = (out[turn] ??= { recordTurn: t.turn, stt_final_ms: null, voice_to_voice_ms: null, llm_first_token_ms: null,
                                 tts_first_chunk_ms: null, first_audio_ms: null, dead_air_ms: null, causes: {}, sent: false });
      if (i === 0) f.stt_final_ms = t.stt_final_ms ?? null;
      if (!reply) return;
      const sent = reply.voice_to_voice_ms != null || reply.timings?.first_audio_ms != null;
      if (f.dead_air_ms === null || (sent && !f.sent)) {
        const timings = reply.timings || {};
        Object.assign(f, { voice_to_voice_ms: reply.voice_to_voice_ms ?? null, llm_first_token_ms: timings.llm_first_token_ms ?? null,
                           tts_first_chunk_ms: timings.tts_first_chunk_ms ?? null, first_audio_ms: timings.first_audio_ms ?? null, sent });
      }
      f.dead_air_ms ??= 0;
      for (const gap of reply.gaps || []) {
        f.dead_air_ms += gap.ms;
        f.causes[gap.cause] = (f.causes[gap.cause] || 0) + gap.ms;
        gaps.push({ turn, at_ms: gap.at_ms, ms: gap.ms, cause: gap.cause });
      }
    });
  }
  return { turns: out, gaps };
}
