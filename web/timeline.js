// The live timeline of the call: a canvas strip, in time since connect, with three lanes:
//   you       the user's speech (the server's VAD: v1 speech.started/stopped, Realtime
//             input_audio_buffer.speech_started/stopped)
//   bot       each reply's audio (v1: its first audio chunk to response.done; WebRTC:
//             output_audio_buffer.started to stopped/cleared, or response.done once the track is quiet)
//   dead air  gaps inside a reply, coloured by cause: the server's (its call record: llm, tts,
//             client, engine_unavailable; placed at the reply's first audio here + the gap's at_ms),
//             and the page's own playback underruns (v1: the playback worklet ran dry: "playback")
// The whole call fits the strip until MAX_SPAN_MS; after that it scrolls (the last MAX_SPAN_MS).
// `stats` (window.gapless.timeline) counts what the last draw drew.
export const COLOURS = {
  speech: "#1a73e8", reply: "#188038",
  llm: "#f9ab00", tts: "#e8710a", client: "#9334e6", engine_unavailable: "#d93025", playback: "#e52592",
};
export const CAUSES = ["llm", "tts", "client", "engine_unavailable", "playback"];
const MIN_SPAN_MS = 20_000;
const MAX_SPAN_MS = 120_000;
const HEIGHT = 96;
const LEFT = 62; // the lanes' labels
// y, height, label of each lane; dead air: the server's (its record) above, the page's playback below
const LANES = { speech: [6, 16, "you"], reply: [27, 16, "bot"], gap: [48, 9, "dead air"], playback: [59, 9, ""] };

export class Timeline {
  constructor(canvas, stats) {
    this.canvas = canvas;
    this.stats = stats;
    this.reset(performance.now());
  }

  reset(t0) {
    this.t0 = t0;
    this.end = null; // the call's end (ms since t0), once it ended
    this.segments = []; // {kind: "speech"|"reply"|"gap", start, end (null: still open), turn?, cause?}
    this.serverGaps = []; // {turn, at_ms, ms, cause} from the record
    Object.assign(this.stats, { speech: 0, reply: 0, gaps: 0, drawn: { speech: 0, reply: 0, gap: 0 }, byCause: {}, spanS: 0 });
  }

  ms(now) {
    return now - this.t0;
  }

  open(kind, now, extra = {}) {
    const seg = { kind, start: this.ms(now), end: null, ...extra };
    this.segments.push(seg);
    this.stats[kind === "gap" ? "gaps" : kind]++;
    return seg;
  }

  last(kind, test = () => true) {
    for (let i = this.segments.length - 1; i >= 0; i--) {
      const s = this.segments[i];
      if (s.kind === kind && test(s)) return s;
    }
    return null;
  }

  close(seg, now) {
    if (seg && seg.end === null) seg.end = Math.max(seg.start, this.ms(now));
  }

  speechStart(now) {
    if (!this.last("speech", (s) => s.end === null)) this.open("speech", now);
  }

  speechStop(now) {
    this.close(this.last("speech", (s) => s.end === null), now);
  }

  // A reply's audio began (key: the turn on v1, the response id on WebRTC; turn: the page's turn).
  replyStart(key, turn, now) {
    if (!this.last("reply", (s) => s.key === key)) this.open("reply", now, { key, turn });
  }

  replyEnd(key, now) {
    this.close(this.last("reply", (s) => s.key === key && s.end === null), now);
  }

  // v1 playback: the worklet ran dry (underrun) and started again (rebuffered), or the reply was flushed.
  underrun(turn, now) {
    this.open("gap", now, { cause: "playback", turn });
  }

  rebuffered(now) {
    this.close(this.last("gap", (s) => s.cause === "playback" && s.end === null), now);
  }

  // The record's gaps, all of them each time (a fetched record replaces the last).
  setServerGaps(gaps) {
    this.serverGaps = gaps;
  }

  // The call ended: whatever is open ends now.
  stop(now) {
    for (const s of this.segments) this.close(s, now);
    this.end = this.ms(now);
  }

  // Every gap to draw, as {start, end, cause}: the page's own, and the record's, placed at the
  // first audio of their turn's reply here.
  gaps() {
    const out = this.segments.filter((s) => s.kind === "gap");
    for (const g of this.serverGaps) {
      const reply = this.segments.find((s) => s.kind === "reply" && s.turn === g.turn);
      if (reply) out.push({ start: reply.start + g.at_ms, end: reply.start + g.at_ms + g.ms, cause: g.cause });
    }
    return out;
  }

  draw(now) {
    const c = this.canvas;
    const dpr = window.devicePixelRatio || 1;
    const w = c.clientWidth || 600;
    if (c.width !== Math.round(w * dpr) || c.height !== Math.round(HEIGHT * dpr)) {
      c.width = Math.round(w * dpr);
      c.height = Math.round(HEIGHT * dpr);
    }
    const g = c.getContext("2d");
    g.setTransform(dpr, 0, 0, dpr, 0, 0);
    g.clearRect(0, 0, w, HEIGHT);
    const end = this.end ?? this.ms(now);
    const span = Math.max(MIN_SPAN_MS, Math.min(end, MAX_SPAN_MS));
    const from = Math.max(0, end - span);
    const scale = (w - LEFT - 10) / span;
    const x = (t) => LEFT + (t - from) * scale;
    g.font = "11px system-ui, sans-serif";
    g.textBaseline = "middle";
    for (const [y, h, label] of Object.values(LANES)) {
      g.fillStyle = "#f3f3f3";
      g.fillRect(LEFT, y, w - LEFT - 10, h);
      g.fillStyle = "#555";
      g.fillText(label, 4, y + h / 2);
    }
    this.ticks(g, from, span, x);
    const drawn = { speech: 0, reply: 0, gap: 0, playback: 0 };
    const byCause = {};
    const bar = (kind, s, e, colour) => {
      if (e < from) return null;
      const x0 = x(Math.max(s, from));
      const x1 = Math.max(x(Math.min(e, end)), x0 + 2);
      const [y, h] = LANES[kind];
      g.fillStyle = colour;
      g.fillRect(x0, y, x1 - x0, h);
      drawn[kind]++;
      return [x0, x1, y, h];
    };
    for (const s of this.segments) {
      if (s.kind === "gap") continue;
      const at = bar(s.kind, s.start, s.end ?? end, COLOURS[s.kind]);
      if (at && s.kind === "reply" && at[1] - at[0] > 14) {
        g.fillStyle = "white";
        g.fillText(String(s.turn), at[0] + 3, at[2] + at[3] / 2);
      }
    }
    for (const gap of this.gaps()) {
      const lane = gap.cause === "playback" ? "playback" : "gap";
      if (bar(lane, gap.start, gap.end, COLOURS[gap.cause] || "#333")) byCause[gap.cause] = (byCause[gap.cause] || 0) + 1;
    }
    drawn.gap += drawn.playback;
    delete drawn.playback;
    g.fillStyle = "#1d1d1f";
    g.fillRect(x(end) - 1, 2, 2, 70); // now
    Object.assign(this.stats, { drawn, byCause, spanS: Math.round(span / 100) / 10 });
  }

  ticks(g, from, span, x) {
    const step = [1, 2, 5, 10, 15, 30, 60].find((s) => span / (s * 1000) <= 10) * 1000;
    g.fillStyle = "#777";
    g.strokeStyle = "#ddd";
    for (let t = Math.ceil(from / step) * step; t <= from + span; t += step) {
      const px = x(t);
      g.beginPath();
      g.moveTo(px + 0.5, 2);
      g.lineTo(px + 0.5, 72);
      g.stroke();
      g.fillText(`${t / 1000} s`, px - 8, 85);
    }
  }
}
