// The browser's audio: the microphone in at 16 kHz, the reply out at 24 kHz.
//
// Playback goes worklet -> MediaStreamAudioDestinationNode -> <audio> element, not to the
// AudioContext's own destination: Chrome's echo canceller (getUserMedia echoCancellation)
// takes as its reference what plays through media elements and WebRTC, not what plays
// through Web Audio's destination, so a reply played that way would come back into the
// microphone uncancelled. See docs/web-client.md for what was verified.

export const INPUT_RATE = 16000;
export const OUTPUT_RATE = 24000;
export const FRAME_MS = 40;

export class Microphone {
  // onFrame(ArrayBuffer of int16, 16 kHz) for every FRAME_MS of captured audio.
  constructor(onFrame) {
    this.onFrame = onFrame;
    this.sending = true; // push-to-talk turns this off between turns
    this.frames = 0;
  }

  async start() {
    this.stream = await navigator.mediaDevices.getUserMedia({
      audio: { echoCancellation: true, noiseSuppression: true, autoGainControl: true, channelCount: 1 },
    });
    this.ctx = new AudioContext({ sampleRate: INPUT_RATE });
    await this.ctx.audioWorklet.addModule(new URL("./worklets/capture.js", import.meta.url));
    const source = this.ctx.createMediaStreamSource(this.stream);
    this.node = new AudioWorkletNode(this.ctx, "capture-processor", {
      processorOptions: { frameSamples: (INPUT_RATE * FRAME_MS) / 1000 },
    });
    this.node.port.onmessage = (e) => {
      if (e.data.type === "frame" && this.sending) {
        this.frames++;
        this.onFrame(e.data.pcm);
      }
    };
    source.connect(this.node);
    await this.ctx.resume();
    const track = this.stream.getAudioTracks()[0];
    return { label: track.label, settings: track.getSettings(), sampleRate: this.ctx.sampleRate };
  }

  async stop() {
    if (this.stream) this.stream.getTracks().forEach((t) => t.stop());
    if (this.ctx) await this.ctx.close();
    this.stream = this.ctx = this.node = null;
  }
}

export class Player {
  // onEvent({type: "started"|"underrun"|"flushed"|"stats", ...}) from the playback worklet.
  constructor(audioElement, jitterMs, onEvent) {
    this.audioElement = audioElement;
    this.jitterMs = jitterMs;
    this.onEvent = onEvent;
  }

  async start() {
    this.ctx = new AudioContext({ sampleRate: OUTPUT_RATE });
    await this.ctx.audioWorklet.addModule(new URL("./worklets/playback.js", import.meta.url));
    this.node = new AudioWorkletNode(this.ctx, "playback-processor", {
      outputChannelCount: [1],
      processorOptions: { jitterMs: this.jitterMs },
    });
    this.node.port.onmessage = (e) => this.onEvent(e.data);
    const sink = this.ctx.createMediaStreamDestination();
    this.node.connect(sink);
    this.audioElement.srcObject = sink.stream;
    await this.ctx.resume();
    await this.audioElement.play();
  }

  // pcm: Uint8Array of int16 LE (msgpack bin); copied so the worklet gets an aligned buffer.
  chunk(pcm, turn) {
    const copy = pcm.slice().buffer;
    this.node.port.postMessage({ type: "chunk", pcm: copy, turn }, [copy]);
  }

  end(turn) {
    this.node.port.postMessage({ type: "end", turn });
  }

  flush() {
    this.node.port.postMessage({ type: "flush" });
  }

  async stop() {
    this.audioElement.pause();
    this.audioElement.srcObject = null;
    if (this.ctx) await this.ctx.close();
    this.ctx = this.node = null;
  }
}
