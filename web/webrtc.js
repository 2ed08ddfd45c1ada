// The OpenAI Realtime protocol over WebRTC (docs/webrtc.md): the microphone goes out as an Opus
// track with the browser's own echo cancellation and noise suppression, the reply comes back as
// a track the page plays, and the Realtime events travel on the "oai-events" data channel.
import { micConstraints } from "./audio.js";
import { postForJson } from "./client.js";

// An ephemeral key for the call (POST /v1/realtime/client_secrets, as OpenAI's): the page sends
// it as the Bearer of its offer, so the server's token never sits in a request the page makes
// for a call. With auth off the server still issues one.
export async function fetchCallKey(token) {
  return (await postForJson("/v1/realtime/client_secrets", token, {}, "key request")).value;
}

// Waits for the offer's ICE candidates (the server takes no trickled candidates), at most 3 s.
function gathered(pc) {
  if (pc.iceGatheringState === "complete") return Promise.resolve();
  return new Promise((resolve) => {
    const done = () => { if (pc.iceGatheringState === "complete") resolve(); };
    pc.addEventListener("icegatheringstatechange", done);
    setTimeout(resolve, 3000);
  });
}

export class RealtimeCall {
  // handlers: {onEvent(event), onTrack(stream), onClose(reason)}
  constructor(handlers) {
    this.handlers = handlers;
    this.pc = null;
    this.channel = null;
    this.stream = null;
    this.location = null;
    this.queue = []; // events sent before the channel opened
  }

  // deviceId: the microphone chosen (web/devices.js), or the browser's default.
  async open(key, session, deviceId = "") {
    this.stream = await navigator.mediaDevices.getUserMedia(micConstraints(deviceId));
    const pc = (this.pc = new RTCPeerConnection());
    for (const track of this.stream.getAudioTracks()) pc.addTrack(track, this.stream);
    pc.ontrack = (e) => this.handlers.onTrack(e.streams[0] || new MediaStream([e.track]));
    pc.onconnectionstatechange = () => {
      if (["failed", "closed"].includes(pc.connectionState)) this.handlers.onClose(pc.connectionState);
    };
    const channel = (this.channel = pc.createDataChannel("oai-events"));
    channel.onmessage = (e) => this.handlers.onEvent(JSON.parse(e.data));
    channel.onopen = () => { for (const event of this.queue.splice(0)) channel.send(JSON.stringify(event)); };
    channel.onclose = () => this.handlers.onClose("closed");
    await pc.setLocalDescription(await pc.createOffer());
    await gathered(pc);
    const form = new FormData();
    form.set("sdp", pc.localDescription.sdp);
    form.set("session", JSON.stringify(session || {}));
    const r = await fetch("/v1/realtime/calls", { method: "POST", body: form,
                                                  headers: key ? { Authorization: `Bearer ${key}` } : {} });
    if (r.status !== 201) {
      const body = await r.json().catch(() => ({}));
      const error = body.error || body;
      throw Object.assign(new Error(error.message || `the call was refused: HTTP ${r.status}`),
                          { code: error.code || `http_${r.status}` });
    }
    this.location = r.headers.get("Location");
    await pc.setRemoteDescription({ type: "answer", sdp: await r.text() });
  }

  // Another microphone, mid-call: its track replaces the one the call sends.
  async switchMicrophone(deviceId) {
    const stream = await navigator.mediaDevices.getUserMedia(micConstraints(deviceId));
    const sender = this.pc && this.pc.getSenders().find((s) => s.track && s.track.kind === "audio");
    if (!sender) return stream.getTracks().forEach((t) => t.stop());
    await sender.replaceTrack(stream.getAudioTracks()[0]);
    this.stream.getTracks().forEach((t) => t.stop());
    this.stream = stream;
  }

  send(event) {
    if (this.channel && this.channel.readyState === "open") this.channel.send(JSON.stringify(event));
    else this.queue.push(event);
  }

  close() {
    if (this.pc) this.pc.close();
    if (this.stream) for (const track of this.stream.getTracks()) track.stop();
    this.pc = this.channel = this.stream = null;
  }
}

// Loudness of what the reply track delivers, as the page receives it: RMS of 20 ms windows.
export class TrackMeter {
  constructor(stream, onWindow) {
    this.ctx = new AudioContext();
    this.analyser = this.ctx.createAnalyser();
    this.analyser.fftSize = 1024;
    this.ctx.createMediaStreamSource(stream).connect(this.analyser);
    const data = new Float32Array(this.analyser.fftSize);
    this.timer = setInterval(() => {
      this.analyser.getFloatTimeDomainData(data);
      let sum = 0;
      for (const v of data) sum += v * v;
      onWindow(Math.sqrt(sum / data.length));
    }, 20);
  }

  stop() {
    clearInterval(this.timer);
    this.ctx.close();
  }
}
