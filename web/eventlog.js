// The event log: the last MAX_EVENTS events of the call, newest at the top, each with its time
// since connect, its type and a short summary. `entries` (window.gapless.log) mirrors the list.
export const MAX_EVENTS = 200;

export class EventLog {
  constructor(list, entries) {
    this.list = list; // the <ol> shown
    this.entries = entries; // [{t (s since connect), type, summary}], newest first
    this.t0 = performance.now();
  }

  reset(t0) {
    this.t0 = t0;
    this.entries.length = 0;
    this.list.replaceChildren();
  }

  add(type, summary = "") {
    const t = Math.round(performance.now() - this.t0) / 1000;
    this.entries.unshift({ t, type, summary });
    if (this.entries.length > MAX_EVENTS) this.entries.length = MAX_EVENTS;
    const li = document.createElement("li");
    const time = document.createElement("span");
    time.className = "t";
    time.textContent = `${t.toFixed(2)} s`;
    const kind = document.createElement("code");
    kind.textContent = type;
    li.append(time, kind, document.createTextNode(summary ? ` ${summary}` : ""));
    this.list.prepend(li);
    while (this.list.childElementCount > MAX_EVENTS) this.list.lastElementChild.remove();
  }
}

const clip = (text, n = 80) => (text.length > n ? `${text.slice(0, n)}…` : text);
const msOf = (timings) => Object.entries(timings || {}).map(([k, v]) => `${k.replace(/_ms$/, "")} ${Math.round(v)} ms`).join(", ");

// A short summary of a protocol v1 message (docs/protocol.md), or null for those not logged
// (audio chunks after a turn's first, partial transcripts, reply text deltas: too many to read).
export function summariseV1(msg) {
  switch (msg.type) {
    case "audio": return msg.seq === 0 ? `turn ${msg.turn}: first reply audio` : null;
    case "transcript.partial": case "response.text": return null;
    case "transcript.final": return `turn ${msg.turn}: "${clip(msg.text)}"`;
    case "response.done": return `turn ${msg.turn}${msg.interrupted ? " interrupted" : ""}${msg.timings ? `: ${msOf(msg.timings)}` : ""}`;
    case "speech.started": case "speech.stopped": return `at ${msg.audio_ms} ms of the microphone`;
    case "tool.call": return `${msg.name}(${clip(msg.arguments || "", 60)}), turn ${msg.turn}: not run (this page runs no tools)`;
    case "tool.cancelled": return `${msg.call_id}: ${msg.reason}`;
    case "session.updated": return settingsSummary(msg.settings || {});
    case "error": return `${msg.code}: ${clip(msg.message || "", 120)}`;
    default: return msg.turn !== undefined ? `turn ${msg.turn}` : "";
  }
}

// The same for an OpenAI Realtime event (the WebRTC data channel); deltas are not logged.
export function summariseRealtime(ev) {
  if (ev.type.endsWith(".delta")) return null;
  switch (ev.type) {
    case "session.created": case "session.updated": {
      const s = ev.session || {};
      return `${ev.type === "session.created" ? `session ${s.id}: ` : ""}voice ${(s.audio?.output?.voice) ?? "?"}, ` +
        `${(s.tools || []).length} tools${s.instructions ? `, instructions "${clip(s.instructions, 40)}"` : ""}`;
    }
    case "conversation.item.input_audio_transcription.completed": return `"${clip(ev.transcript || "")}"`;
    case "response.function_call_arguments.done": return `${ev.name}(${clip(ev.arguments || "", 60)}): not run (this page runs no tools)`;
    case "response.done": {
      const r = ev.response || {};
      return `${r.id}: ${r.status}${r.status_details?.reason ? ` (${r.status_details.reason})` : ""}`;
    }
    case "error": return `${ev.error?.code}: ${clip(ev.error?.message || "", 120)}`;
    default: return ev.response_id || ev.response?.id || ev.item_id || ev.item?.id || "";
  }
}

function settingsSummary(s) {
  return `voice ${s.voice}, ${(s.tools || []).length} tools${s.instructions ? `, instructions "${clip(s.instructions, 40)}"` : ""}`;
}
