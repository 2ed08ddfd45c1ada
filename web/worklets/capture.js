// Microphone capture: the AudioContext runs at 16 kHz, so the samples arrive at the protocol's
// input rate. They are cut into frames of `frameSamples` (640 = 40 ms) and posted to the page
// as int16, which sends each one as an `audio` message.
class CaptureProcessor extends AudioWorkletProcessor {
  constructor(options) {
    super();
    this.frameSamples = options.processorOptions.frameSamples;
    this.frame = new Int16Array(this.frameSamples);
    this.filled = 0;
    this.captured = 0;
  }

  process(inputs) {
    const input = inputs[0] && inputs[0][0];
    if (!input) return true;
    for (let i = 0; i < input.length; i++) {
      const s = Math.max(-1, Math.min(1, input[i]));
      this.frame[this.filled++] = s < 0 ? s * 0x8000 : s * 0x7fff;
      if (this.filled === this.frameSamples) {
        this.port.postMessage({ type: "frame", pcm: this.frame.buffer }, [this.frame.buffer]);
        this.frame = new Int16Array(this.frameSamples);
        this.filled = 0;
      }
    }
    this.captured += input.length;
    return true;
  }
}

registerProcessor("capture-processor", CaptureProcessor);
