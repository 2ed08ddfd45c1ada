// The browser's audio: the microphone in and the reply out, each at the rate the server
// announced in session.ready (input_sample_rate, output_sample_rate).
//
// Each AudioContext is created at the server's rate, so the browser itself resamples: the
// microphone (a MediaStreamAudioSourceNode feeding a context at another rate than the device's)
// and the reply (the context's output is converted to the device's rate by the browser). A
// browser that will not do that (the constructor or createMediaStreamSource throws, or the
// context comes up at another rate) is told so: start throws, and the session gets no audio.
//
// Playback goes worklet -> MediaStreamAudioDestinationNode -> <audio> element, not to the
// AudioContext's own destination: Chrome's echo canceller (getUserMedia echoCancellation)
// takes as its reference what plays through media elements and WebRTC, not what plays
// through Web Audio's destination, so a reply played that way would come back into the
// microphone uncancelled. See docs/web-client.md for what was verified.

export const FRAME_MS = 40;

function cannotRunAt(rate, why) {
  return Object.assign(new Error(`this browser cannot run audio at ${rate} Hz (${why}): try Chromium`),
                       { code: "unsupported_sample_rate" });
}

// An AudioContext at `rate`, or the error that says this browser will not make one.
function contextAt(rate) {
  let ctx;
  try {
    ctx = new AudioContext({ sampleRate: rate });
  } catch (err) {
    throw cannotRunAt(rate, err.name);
  }
  if (ctx.sampleRate !== rate) {
    ctx.close();
    throw cannotRunAt(rate, `it ran at ${ctx.sampleRate} Hz`);
  }
  return ctx;
}

// getUserMedia's audio constraints: the browser's echo canceller and the rest on, and the
// microphone chosen (web/devices.js; "" or none: the browser's default).
export function micConstraints(deviceId) {
  const audio = { echoCancellation: true, noiseSuppression: true, autoGainControl: true, channelCount: 1 };
  if (deviceId) audio.deviceId = { exact: deviceId };
  return { audio };
}

export class Microphone {
  // onFrame(ArrayBuffer of int16 at the rate given to start) for every FRAME_MS of captured
  // audio, and a shorter one for the rest of a push-to-talk turn when it stops. deviceId: the
  // microphone chosen (web/devices.js), or the browser's default.
  constructor(onFrame, deviceId = "") {
    this.onFrame = onFrame;
    this.deviceId = deviceId;
    this.frames = 0;
    this.sent = 0; // samples given to onFrame since the last startSending
    this.stopped = null; // resolves the pending stopSending
  }

  // The permission prompt: before a session is opened, so that it does not wait on the user.
  async open() {
    this.stream = await navigator.mediaDevices.getUserMedia(micConstraints(this.deviceId));
  }

  // Another microphone, mid-call: its stream feeds the same capture worklet.
  async switchTo(deviceId) {
    const stream = await navigator.mediaDevices.getUserMedia(micConstraints(deviceId));
    const source = this.ctx ? this.ctx.createMediaStreamSource(stream) : null;
    if (source) {
      source.connect(this.node);
      this.source.disconnect();
    }
    if (this.stream) this.stream.getTracks().forEach((t) => t.stop());
    [this.stream, this.source, this.deviceId] = [stream, source, deviceId];
  }

  // Capture for a session whose input rate is `rate`; `sending`: from now (hands-free), or only
  // between startSending and stopSending (push-to-talk).
  async start(rate, sending) {
    this.ctx = contextAt(rate);
    let source;
    try {
      source = this.source = this.ctx.createMediaStreamSource(this.stream);
    } catch (err) {
      throw cannotRunAt(rate, err.name); // a browser that connects a microphone only at its own rate
    }
    await this.ctx.audioWorklet.addModule(new URL("./worklets/capture.js", import.meta.url));
    this.node = new AudioWorkletNode(this.ctx, "capture-processor", {
      processorOptions: { frameSamples: Math.round((rate * FRAME_MS) / 1000), sending },
    });
    this.node.port.onmessage = (e) => {
      if (e.data.type === "frame") {
        this.frames++;
        this.sent += e.data.pcm.byteLength / 2;
        this.onFrame(e.data.pcm);
      } else if (e.data.type === "stopped" && this.stopped) {
        const done = this.stopped;
        this.stopped = null;
        done({ captured: e.data.captured, sent: this.sent });
      }
    };
    source.connect(this.node);
    await this.ctx.resume();
    const track = this.stream.getAudioTracks()[0];
    return { label: track.label, settings: track.getSettings(), sampleRate: this.ctx.sampleRate, rate };
  }

  // Push-to-talk: send from now on.
  startSending() {
    this.sent = 0;
    this.node.port.postMessage({ type: "start" });
  }

  // Push-to-talk: stop sending. Resolves, with {captured, sent} (samples), once every sample
  // captured until now, the last partial frame included, has gone to onFrame.
  stopSending() {
    return new Promise((resolve) => {
      this.stopped = resolve;
      this.node.port.postMessage({ type: "stop" });
    });
  }

  async stop() {
    if (this.stopped) this.stopped({ captured: 0, sent: this.sent });
    if (this.stream) this.stream.getTracks().forEach((t) => t.stop());
    if (this.ctx) await this.ctx.close();
    this.stream = this.ctx = this.node = this.source = this.stopped = null;
  }
}

export class Player {
  // onEvent({type: "started"|"underrun"|"flushed"|"stats", ...}) from the playback worklet.
  constructor(audioElement, jitterMs, onEvent) {
    this.audioElement = audioElement;
    this.jitterMs = jitterMs;
    this.onEvent = onEvent;
  }

  // Playback of replies at `rate` (the server's output rate).
  async start(rate) {
    this.ctx = contextAt(rate);
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
    return { sampleRate: this.ctx.sampleRate, rate };
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

  // The server paused the reply (response.paused): stop playing, keep what is buffered.
  hold() {
    this.node.port.postMessage({ type: "hold" });
  }

  // ...and resumed it (response.resumed): play on from where it stopped.
  release() {
    this.node.port.postMessage({ type: "release" });
  }

  async stop() {
    this.audioElement.pause();
    this.audioElement.srcObject = null;
    if (this.ctx) await this.ctx.close();
    this.ctx = this.node = null;
  }
}
