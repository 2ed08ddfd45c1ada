// The agent's settings the page lets you set: instructions, voice, tools (docs/agents.md).
// Applied at connect and by Apply mid-call: protocol v1 sends `session.update` (docs/protocol.md,
// "Agent settings"); WebRTC puts them in the call's session object, then sends Realtime
// `session.update` (instructions, audio.output.voice, tools). The page runs no tools: a tool
// call shows in the event log, and the server's tool timeout answers it.
//
// Over protocol v1 the server names its voices (session.ready's `voices`, offered once it came);
// before that, and over WebRTC (whose session does not list them): "default", OpenAI's voice
// names (they speak as "default" unless the server maps them elsewhere, tts.voice_aliases), and
// "other…" to type a voice of the server's own configuration ("robot" in serve_config.yaml).
export const VOICES = ["default", "alloy", "ash", "ballad", "coral", "echo", "sage", "shimmer", "verse", "marin", "cedar"];

export class AgentControls {
  // links() -> [v1 Conversation or null, RealtimeCall or null]: what Apply sends over;
  // log(type, summary): what was sent, or why nothing was.
  constructor(els, state, links, log) {
    Object.assign(this, { els, state, links, log }); // els: {instructions, voice, voiceOther, tools, apply, error}
    els.apply.addEventListener("click", () => {
      try {
        this.send(this.read(true), ...this.links());
      } catch (err) {
        log("settings", err.message); // shown under the tools too; nothing is sent
      }
    });
    const params = new URLSearchParams(window.location.search);
    els.voice.replaceChildren(...VOICES.map((v) => new Option(v, v)), new Option("other…", "other"));
    const voice = params.get("voice");
    if (voice) {
      els.voice.value = VOICES.includes(voice) ? voice : "other";
      if (!VOICES.includes(voice)) els.voiceOther.value = voice;
    }
    if (params.has("instructions")) els.instructions.value = params.get("instructions");
    const other = () => { els.voiceOther.hidden = els.voice.value !== "other"; };
    els.voice.addEventListener("change", other);
    other();
    els.tools.addEventListener("input", () => this.check());
  }

  // The voices a server named (session.ready): the picker offers those, keeping the choice made.
  offer(voices) {
    if (!Array.isArray(voices) || !voices.length) return;
    const chosen = this.voice;
    this.els.voice.replaceChildren(...voices.map((v) => new Option(v, v)), new Option("other…", "other"));
    this.els.voice.value = voices.includes(chosen) ? chosen : (chosen ? "other" : voices[0]);
    if (this.els.voice.value === "other") this.els.voiceOther.value = chosen;
    this.els.voiceOther.hidden = this.els.voice.value !== "other";
    this.state.voices = voices;
  }

  get voice() {
    return this.els.voice.value === "other" ? this.els.voiceOther.value.trim() : this.els.voice.value;
  }

  // The settings: {instructions, voice, tools}. `all`: every one (Apply: an empty field puts the
  // server's own back); else only those set (at connect). Throws on tools that are not a JSON list
  // of function tools, with the reason; nothing is sent then.
  read(all) {
    const tools = this.check();
    if (tools instanceof Error) throw tools;
    const out = {};
    const instructions = this.els.instructions.value.trim();
    if (instructions || all) out.instructions = instructions || null;
    if (this.voice !== "default" || all) out.voice = this.voice || "default";
    if (tools.length || all) out.tools = tools;
    return out;
  }

  // The tools, parsed and checked as far as the page can (the server checks their schemas), or
  // the Error saying what is wrong; shown under the field.
  check() {
    const text = this.els.tools.value.trim();
    let tools = [];
    let err = null;
    if (text) {
      try {
        tools = JSON.parse(text);
        if (!Array.isArray(tools)) tools = [tools];
        const bad = tools.findIndex((t) => !t || typeof t !== "object" || typeof t.name !== "string" || !t.name ||
                                           (t.type !== undefined && t.type !== "function"));
        if (bad >= 0) err = `tools[${bad}] is not a function tool ({"type": "function", "name": …, "parameters": {…}})`;
        tools = tools.map((t) => ({ type: "function", ...t }));
      } catch (e) {
        err = `the tools are not JSON (${e.message})`;
      }
    }
    this.els.error.hidden = !err;
    this.els.error.textContent = err || "";
    return err ? Object.assign(new Error(err), { code: "bad_tools_json" }) : tools;
  }

  // protocol v1: one session.update (null when there is nothing to send)
  v1Update(settings) {
    return Object.keys(settings).length ? { type: "session.update", ...settings } : null;
  }

  // OpenAI Realtime: the session object's fields for these settings
  realtimeSession(settings) {
    const s = {};
    if ("instructions" in settings) s.instructions = settings.instructions ?? "";
    if ("voice" in settings) s.audio = { output: { voice: settings.voice } };
    if ("tools" in settings) s.tools = settings.tools;
    return s;
  }

  // Sends the settings over the call there is: v1 session.update, or Realtime session.update.
  send(settings, conv, call) {
    if (call) call.send({ type: "session.update", session: { type: "realtime", ...this.realtimeSession(settings) } });
    else if (conv) conv.send(this.v1Update(settings));
    else return;
    this.sent(settings);
    this.log("sent session.update", Object.entries(settings).map(([k, v]) => `${k} ${JSON.stringify(v).slice(0, 40)}`).join(", "));
  }

  sent(settings) {
    this.state.settings = settings;
  }
}
