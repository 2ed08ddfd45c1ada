// Reply playback: a ring buffer with a jitter buffer in front of it.
//
// The AudioContext runs at the server's output rate (from session.ready), so the replies'
// samples are played as they are, and the counts this posts are in reply samples (`rate` in the
// stats is that rate).
//
// A reply starts playing once `jitterSamples` of it are buffered (or its last chunk is in).
// If the buffer runs dry before the reply's end, that is an underrun: it is counted (for the
// reply's turn) and playback waits for the jitter buffer to fill again. `flush` (the server
// interrupted the reply) drops everything buffered at once. `hold` (the server paused the reply:
// response.paused) stops playing and keeps what is buffered; `release` plays on from there.
//
// In:  {type: "chunk", pcm: ArrayBuffer (int16), turn}, {type: "end", turn}, {type: "flush"},
//      {type: "hold"}, {type: "release"}, {type: "jitter", ms}
// Out: {type: "started", turn, played} when a turn's first sample plays, {type: "underrun", turn},
//      {type: "rebuffered", turn} when it plays again after an underrun, {type: "flushed", dropped, played},
//      and every ~50 ms {type: "stats", played, buffered, underruns, overflowed, rate}.
const CAPACITY = sampleRate * 30; // 30 s: far above what the server's pacing (0.3 s lead) ever sends ahead

class PlaybackProcessor extends AudioWorkletProcessor {
  constructor(options) {
    super();
    this.ring = new Float32Array(CAPACITY);
    this.read = 0; // total samples consumed
    this.write = 0; // total samples written
    this.segments = []; // [{turn, left}] in play order: which turn the buffered samples belong to
    this.jitterSamples = Math.round((options.processorOptions.jitterMs / 1000) * sampleRate);
    this.playing = false;
    this.held = false; // paused by the server: nothing plays, nothing is dropped
    this.endedTurn = -1; // the newest turn whose last chunk is in
    this.startedTurn = -1;
    this.dry = null; // the turn that ran dry, until it plays again
    this.played = 0;
    this.underruns = 0;
    this.overflowed = 0;
    this.sinceStats = 0;
    this.port.onmessage = (e) => this.onMessage(e.data);
  }

  get buffered() {
    return this.write - this.read;
  }

  onMessage(msg) {
    if (msg.type === "chunk") {
      const pcm = new Int16Array(msg.pcm);
      if (this.buffered + pcm.length > CAPACITY) {
        this.overflowed += pcm.length;
        return;
      }
      for (let i = 0; i < pcm.length; i++) this.ring[(this.write + i) % CAPACITY] = pcm[i] / 32768;
      this.write += pcm.length;
      const last = this.segments[this.segments.length - 1];
      if (last && last.turn === msg.turn) last.left += pcm.length;
      else this.segments.push({ turn: msg.turn, left: pcm.length });
    } else if (msg.type === "end") {
      this.endedTurn = Math.max(this.endedTurn, msg.turn);
    } else if (msg.type === "flush") {
      const dropped = this.buffered;
      this.read = this.write;
      this.segments = [];
      this.playing = false;
      this.held = false;
      this.dry = null;
      this.port.postMessage({ type: "flushed", dropped, played: this.played });
    } else if (msg.type === "hold") {
      this.held = true;
    } else if (msg.type === "release") {
      this.held = false;
    } else if (msg.type === "jitter") {
      this.jitterSamples = Math.round((msg.ms / 1000) * sampleRate);
    }
  }

  process(_inputs, outputs) {
    const out = outputs[0][0];
    let i = 0;
    if (!this.playing && this.segments.length) {
      const turn = this.segments[0].turn;
      // Start once the jitter buffer is full, or the whole rest of the reply is in.
      if (this.buffered >= this.jitterSamples || this.endedTurn >= turn) this.playing = true;
      if (this.playing && this.dry !== null) {
        this.port.postMessage({ type: "rebuffered", turn: this.dry });
        this.dry = null;
      }
    }
    while (this.playing && !this.held && i < out.length && this.buffered > 0) {
      const seg = this.segments[0];
      if (seg.turn !== this.startedTurn) {
        this.startedTurn = seg.turn;
        this.port.postMessage({ type: "started", turn: seg.turn, played: this.played });
      }
      const n = Math.min(out.length - i, seg.left);
      for (let k = 0; k < n; k++) out[i + k] = this.ring[(this.read + k) % CAPACITY];
      this.read += n;
      this.played += n;
      i += n;
      seg.left -= n;
      if (seg.left === 0) this.segments.shift();
      if (!this.segments.length) {
        // Dry: the reply's end, or an underrun if more of it is still to come.
        if (this.endedTurn < seg.turn) {
          this.underruns++;
          this.dry = seg.turn;
          this.port.postMessage({ type: "underrun", turn: seg.turn });
          this.segments.push({ turn: seg.turn, left: 0 }); // keep the turn while it rebuffers
        }
        this.playing = false;
      } else if (this.segments[0].turn !== seg.turn) {
        this.playing = this.buffered >= this.jitterSamples || this.endedTurn >= this.segments[0].turn;
      }
    }
    for (; i < out.length; i++) out[i] = 0;
    this.sinceStats += out.length;
    if (this.sinceStats >= sampleRate / 20) {
      this.sinceStats = 0;
      this.port.postMessage({ type: "stats", played: this.played, buffered: this.buffered,
                              underruns: this.underruns, overflowed: this.overflowed, rate: sampleRate });
    }
    return true;
  }
}

registerProcessor("playback-processor", PlaybackProcessor);
