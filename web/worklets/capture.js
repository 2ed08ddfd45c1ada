// Microphone capture: the AudioContext runs at the server's input rate (from session.ready; the
// browser resamples the microphone into it), so the samples arrive at that rate. They are cut
// into frames of `frameSamples` (40 ms) and posted to the page as int16; the page sends each as
// an `audio` message.
//
// Only while sending: hands-free from the start, push-to-talk between `start` and `stop`.
// In:  {type: "start"} (a new turn: nothing captured before it is sent),
//      {type: "stop"} (the turn's end: what is left of its last frame is posted as a shorter frame)
// Out: {type: "frame", pcm: ArrayBuffer (int16)}, and after a stop
//      {type: "stopped", captured}: the samples taken in since the start, every one of them posted.
class CaptureProcessor extends AudioWorkletProcessor {
  constructor(options) {
    super();
    const { frameSamples, sending } = options.processorOptions;
    this.frameSamples = frameSamples;
    this.frame = new Int16Array(frameSamples);
    this.filled = 0;
    this.sending = sending;
    this.captured = 0;
    this.port.onmessage = (e) => this.onMessage(e.data);
  }

  onMessage(msg) {
    if (msg.type === "start") {
      this.filled = 0;
      this.captured = 0;
      this.sending = true;
    } else if (msg.type === "stop") {
      if (this.sending) {
        if (this.filled) this.post(this.frame.slice(0, this.filled));
        this.filled = 0;
        this.sending = false;
      }
      this.port.postMessage({ type: "stopped", captured: this.captured });
    }
  }

  post(frame) {
    this.port.postMessage({ type: "frame", pcm: frame.buffer }, [frame.buffer]);
  }

  take(samples) {
    for (let i = 0; i < samples.length; i++) {
      const s = Math.max(-1, Math.min(1, samples[i]));
      this.frame[this.filled++] = s < 0 ? s * 0x8000 : s * 0x7fff;
      if (this.filled === this.frameSamples) {
        this.post(this.frame);
        this.frame = new Int16Array(this.frameSamples);
        this.filled = 0;
      }
    }
    this.captured += samples.length;
  }

  process(inputs) {
    const input = inputs[0] && inputs[0][0];
    if (input && this.sending) this.take(input);
    return true;
  }
}

registerProcessor("capture-processor", CaptureProcessor);
