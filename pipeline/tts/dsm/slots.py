"""Many DSM speech streams in one batched step: a row each of one long-lived ``LMGen``.

Each row is a stream with its own words, text state machine (``moshi.models.tts.StateMachine``),
step count and voice; rows join, wait and leave between steps:

- **open**: the row's streaming state is reset (``reset_streaming(mask)``), its voice's
  cross-attention keys and values (computed once per voice) are written into the row, and a new
  state machine starts.
- **push**: words arrive as the LLM streams them; a word is whole once whitespace follows it (or
  the text ends). Words become ``Entry``s as moshi's ``script_to_entries`` makes them.
- **step**: a row runs when the model can take its next word with the right lookahead (more words
  queued than ``second_stream_ahead``), when it is forced to pad, or when its text is complete;
  other rows wait (``set_exec_mask``: ``LMGen`` with ``support_out_of_sync`` keeps an offset per
  row). So a stream's tokens do not depend on when its words came or who shares the batch.
- A row is done ``delay_steps + final_padding`` steps after its last word, as moshi's
  ``TTSModel.generate`` stops.

The state machine decides on the host, from the sampled text token, what text goes in next: a
step reads the batch's sampled text tokens to the host (as moshi's own TTS server does), and its
frame's codes once.
"""
from __future__ import annotations

import re
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

import torch

WHITESPACE = re.compile(r"\s")


@dataclass
class Row:
    """The host's side of one stream: its words not yet whole, its state machine, its steps."""

    voice: str
    state: object  # moshi.models.tts.State
    steps: int = 0  # steps this row has run (its offset)
    pending: str = ""  # text after the last whole word
    final: bool = False  # every word is in
    started: bool = False  # the first word went in (it carries the speaker token)
    frames: list = field(default_factory=list)  # codes [32] of each frame made (with audio or not)
    made: int = 0  # entries made of its words so far (consumed or queued)


class DSMSlots:
    def __init__(self, tts, num_slots: int, voices: dict[str, Path], default_voice: str,
                 cfg_coef: float = 2.0, padding_between: int = 1):
        from moshi.models.lm import LMGen
        from moshi.modules.transformer import StreamingMultiheadAttention

        self.tts, self.lm, self.num_slots = tts, tts.lm, num_slots
        self.machine, self.padding_between = tts.machine, padding_between
        self.rows: list[Row | None] = [None] * num_slots
        if default_voice not in voices:
            raise ValueError(f"the default voice {default_voice!r} is not among the voices {sorted(voices)}")
        self.default_voice = default_voice
        files = {Path(p) for p in voices.values()}  # names sharing a file (aliases) share its state
        attributes = {f: tts.make_condition_attributes([f], cfg_coef) for f in files}
        provide = self.lm.condition_provider.prepare_and_provide
        self._xattn = [m for m in self.lm.modules() if isinstance(m, StreamingMultiheadAttention) and m.cross_attention]
        with torch.no_grad():
            cross = {f: self.lm.fuser.get_cross(provide([a])).to(self.lm.dtype) for f, a in attributes.items()}
            if len({c.shape for c in cross.values()}) != 1:
                raise ValueError("every DSM voice embedding must have the same length to share a batch")
            kv = {f: [m._compute_cross_attention(c, c) for m in self._xattn] for f, c in cross.items()}
        self._kv = {name: kv[Path(p)] for name, p in voices.items()}
        default = Path(voices[default_voice])
        self.gen = LMGen(self.lm, use_sampling=tts.temp > 0, temp=tts.temp, temp_text=tts.temp,
                         condition_tensors=provide([attributes[default]] * num_slots),
                         on_text_hook=self._on_text, on_audio_hook=self._on_audio, support_out_of_sync=True)
        self._stack = ExitStack()
        self._stack.enter_context(self.gen.streaming(num_slots))
        for m, c in zip(self._xattn, [cross[default].expand(num_slots, -1, -1)] * len(self._xattn)):
            m.update_streaming_cross_attention_src(c)  # every row's keys and values exist from the start
        self._input = torch.full((num_slots, self.lm.n_q - self.lm.dep_q, 1), self.machine.token_ids.zero,
                                 dtype=torch.long, device=self.lm.device)
        self._running: list[bool] = [False] * num_slots
        self._audio_from = (self.gen.delays_cuda[1 : 1 + self.lm.dep_q] + tts.delay_steps)[None, :]

    @property
    def voices(self) -> tuple[str, ...]:
        return tuple(sorted(self._kv))

    # ------------------------------------------------------------------ rows
    def open(self, row: int, voice: str | None = None) -> None:
        voice = voice or self.default_voice
        if voice not in self._kv:
            raise KeyError(f"unknown DSM voice {voice!r}; voices: {list(self.voices)}")
        if self.rows[row] is not None:
            raise ValueError(f"DSM row {row} is in use")
        mask = torch.zeros(self.num_slots, dtype=torch.bool, device=self.lm.device)
        mask[row] = True
        self.gen.reset_streaming(mask)
        with torch.no_grad():
            for m, (k, v) in zip(self._xattn, self._kv[voice]):
                state = m._streaming_state
                state.k_cross[row] = k[0]
                state.v_cross[row] = v[0]
        self.rows[row] = Row(voice, self.machine.new_state([]))

    def close(self, row: int) -> None:
        self.rows[row] = None

    def push(self, row: int, text: str, final: bool = False) -> None:
        """More of the row's text; ``final``: it is all in (the last word is whole)."""
        r = self.rows[row]
        if r.final:
            raise RuntimeError(f"DSM row {row}: its text was already complete")
        r.pending += text
        cut = max((m.end() for m in WHITESPACE.finditer(r.pending)), default=0)
        whole, r.pending = (r.pending, "") if final else (r.pending[:cut], r.pending[cut:])
        if whole.strip():
            self._add(r, whole)
        r.final = final

    def _add(self, r: Row, text: str) -> None:
        from moshi.models.tts import script_to_entries

        entries = script_to_entries(self.tts.tokenizer, self.machine.token_ids, self.tts.mimi.frame_rate, [text],
                                    multi_speaker=self.tts.multi_speaker and not r.started,
                                    padding_between=self.padding_between)
        r.started = r.started or bool(entries)
        r.state.entries.extend(entries)
        r.made += len(entries)

    def made(self, row: int) -> int:
        """Entries made of the row's whole words so far: the index the next whole word's entry gets."""
        return self.rows[row].made

    def consumed_at(self, row: int, entry: int) -> int | None:
        """The step at which the row's state machine took entry ``entry`` into the text, if it has:
        its audio begins ``delay_steps`` frames later (as ``TTSModel.generate`` masks it)."""
        times = self.rows[row].state.consumption_times
        return times[entry] if entry < len(times) else None

    def ready(self, row: int) -> bool:
        """Whether the row can run its next step now."""
        r = self.rows[row]
        return r is not None and not self.done(row) and (
            r.final or len(r.state.entries) > self.machine.second_stream_ahead or r.state.forced_padding > 0)

    def done(self, row: int) -> bool:
        """The row has made every frame of its text (as ``TTSModel.generate`` stops)."""
        r = self.rows[row]
        end = r.state.end_step
        return end is not None and r.steps >= end + self.tts.delay_steps + self.tts.final_padding

    # ------------------------------------------------------------------ the step
    @torch.no_grad()
    def step(self) -> list[int]:
        """One step of every ready row; returns them. Each gets its frame's 32 codes in ``frames``
        once past the model's delays (-1 where a codebook has no audio yet)."""
        self._running = [self.ready(b) for b in range(self.num_slots)]
        ran = [b for b, run in enumerate(self._running) if run]
        if not ran:
            return []
        self.gen.set_exec_mask(torch.tensor(self._running, device=self.lm.device))
        frame = self.gen.step(self._input)
        codes = frame[:, 1:, 0].cpu()
        for b in ran:
            r = self.rows[b]
            r.steps += 1
            if r.steps > self.gen.max_delay:
                r.frames.append(codes[b])
        return ran

    def _on_text(self, tokens: torch.Tensor) -> None:
        out = tokens.tolist()
        for b, run in enumerate(self._running):
            if run:
                r = self.rows[b]
                out[b], _ = self.machine.process(r.steps, r.state, out[b])
        tokens[:] = torch.tensor(out, dtype=torch.long, device=tokens.device)

    def _on_audio(self, audio: torch.Tensor) -> None:
        """No audio before each codebook's delay, counted per row (as ``TTSModel.generate`` does)."""
        offsets = self.gen._streaming_state.offsets[:, None]
        audio.masked_fill_(offsets < self._audio_from, self.machine.token_ids.zero)

    def close_all(self) -> None:
        self._stack.close()
