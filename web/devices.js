// Microphone and speaker pickers (navigator.mediaDevices.enumerateDevices). Browsers give device
// labels only once the page may use the microphone, so the lists are filled again after
// getUserMedia (refresh), and whenever a device comes or goes. The microphone chosen is the
// deviceId getUserMedia asks for (web/audio.js, web/webrtc.js); the speaker is the <audio>
// element's sink (HTMLMediaElement.setSinkId), where the browser has it: elsewhere (Firefox
// before 116, Safari) the speaker picker is disabled and says why.
export const CAN_CHOOSE_SPEAKER = typeof HTMLMediaElement !== "undefined" && "setSinkId" in HTMLMediaElement.prototype;

export class DevicePickers {
  // onMicrophone(deviceId) when the user picks another microphone ("" is the browser's default).
  constructor(mic, speaker, note, audio, state, onMicrophone) {
    Object.assign(this, { mic, speaker, note, audio, state, onMicrophone });
    Object.assign(state, { microphones: [], speakers: [], canChooseSpeaker: CAN_CHOOSE_SPEAKER, speaker: "" });
    if (!CAN_CHOOSE_SPEAKER) {
      speaker.disabled = true;
      note.hidden = false;
      note.textContent = "this browser cannot choose the speaker (no HTMLMediaElement.setSinkId): it plays on the system's";
    }
    mic.addEventListener("change", () => onMicrophone(mic.value));
    speaker.addEventListener("change", () => this.applySpeaker());
    if (navigator.mediaDevices) {
      navigator.mediaDevices.addEventListener("devicechange", () => this.refresh());
      this.refresh();
    }
  }

  get microphone() {
    return this.mic.value;
  }

  async refresh() {
    let devices = [];
    try {
      devices = await navigator.mediaDevices.enumerateDevices();
    } catch {
      return;
    }
    // Before permission a browser lists one nameless entry per kind (deviceId ""): not a choice.
    const of = (kind) => devices.filter((d) => d.kind === kind && d.deviceId && d.deviceId !== "default")
      .map((d, i) => ({ deviceId: d.deviceId, label: d.label || `${kind === "audioinput" ? "microphone" : "speaker"} ${i + 1}` }));
    this.state.microphones = of("audioinput");
    this.state.speakers = of("audiooutput");
    fill(this.mic, this.state.microphones, "the browser's default microphone");
    if (CAN_CHOOSE_SPEAKER) fill(this.speaker, this.state.speakers, "the system's default speaker");
  }

  async applySpeaker() {
    try {
      await this.audio.setSinkId(this.speaker.value);
      this.state.speaker = this.speaker.value;
      this.note.hidden = true;
    } catch (err) {
      this.note.hidden = false;
      this.note.textContent = `the speaker could not be chosen (${err.name})`;
    }
  }
}

function fill(select, devices, defaultLabel) {
  const chosen = select.value;
  select.replaceChildren(new Option(defaultLabel, ""), ...devices.map((d) => new Option(d.label, d.deviceId)));
  select.value = devices.some((d) => d.deviceId === chosen) ? chosen : "";
}
