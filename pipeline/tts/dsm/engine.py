"""The DSM family behind the TTS engine contract ``TTSService`` steps (``pipeline/services/tts.py``): the
same ``stream`` / ``step`` / ``cancel`` and :class:`~pipeline.tts.stream.TTSStream` chunks as CSM's
engine, over :class:`~pipeline.tts.dsm.slots.DSMSlots` and one batched Mimi decode per step.

A stream takes a free row when one is free (else it waits, first come first served), with its
voice. Its text goes in whole (:meth:`DSMEngine.stream`, a clause) or word by word as the LLM
writes it (:meth:`DSMEngine.open`, then :meth:`DSMEngine.say`: one stream per reply, so the
model's lead of text on audio is paid once, not per clause); each clause's first chunk is marked.
Each step runs the rows that can go on, and decodes in one Mimi call the frames that carry audio
on every codebook (the first ~19 of a stream are the text's lead on the audio). A stream ends when
its row has made every frame of its text. DSM takes no context of the conversation, and no voice
clip of a session: its voices are speaker embeddings.
"""
from __future__ import annotations

import functools
import hashlib
import os
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from pipeline.engines import EngineBusy
from pipeline.tts.clip_encoder import ClipEncoder, mimi_encode, mimi_encode_piece
from pipeline.tts.config import TTSConfig
from pipeline.tts.dsm.model import DSM_VOICE_REPO, load_dsm, tiny_voice
from pipeline.tts.dsm.slots import DSMSlots
from pipeline.tts.mimi import SlotDecoder, to_int16
from pipeline.tts.stream import StreamRows, TTSStream

MAX_STEPS = 3000  # a stream's steps at most (4 min of speech): a bound whatever the model does


@dataclass(frozen=True)
class DSMVoiceProfile:
    speaker: str  # the voice's name (DSMSlots knows its embedding)
    reference: None = None


class DSMVoices:
    """The contract's voice lookup: a name -> its profile; no context, no clips."""

    def __init__(self, names):
        self.names = tuple(names)

    def voice(self, name: str = "default", reference=None) -> DSMVoiceProfile:
        if reference is not None:
            raise ValueError("a DSM voice takes no voice clip: its voices are speaker embeddings (tts.voices)")
        if name not in self.names:
            raise KeyError(f"unknown voice {name!r}; voices: {list(self.names)}")
        return DSMVoiceProfile(name)

    @staticmethod
    def context(profile, context) -> list:
        return []  # DSM speaks each text on its own


def voice_files(cfg: TTSConfig, tts) -> dict[str, Path]:
    """Each configured voice's embedding file: the real voices from kyutai/tts-voices (in the local
    cache) or a path; the tiny profile's are random embeddings written once per name."""
    out = {}
    for name, spec in cfg.voice_specs().items():
        ref = spec["voice"]
        if ref.endswith(".safetensors"):
            if not os.path.exists(ref):
                raise FileNotFoundError(f"voice {name!r}: no voice embedding at {ref!r}")
            out[name] = Path(ref)
        elif cfg.profile == "tiny":
            from safetensors.torch import save_file

            folder = Path(os.path.expanduser("~")) / ".cache" / "gapless" / "dsm-tiny" / "voices"
            folder.mkdir(parents=True, exist_ok=True)
            out[name] = folder / f"{hashlib.sha1(ref.encode()).hexdigest()[:16]}.safetensors"
            if not out[name].exists():  # written whole, then moved in: a replica starting beside never reads half
                tmp = out[name].with_suffix(f".{os.getpid()}.tmp")
                save_file({"speaker_wavs": tiny_voice(ref)}, str(tmp))
                os.replace(tmp, out[name])
        else:
            from pipeline.runtime.weights import require_pretrained

            require_pretrained(DSM_VOICE_REPO, what="TTS voice", allow_patterns=[ref + "*"])
            out[name] = tts.get_voice_path(ref)
    return out


class DSMEngine(StreamRows):
    sample_rate = 24_000
    num_codebooks = 32

    def __init__(self, cfg: TTSConfig):
        self.cfg, self.num_slots = cfg, cfg.num_slots
        self.device = torch.device(cfg.device)
        self.tts = load_dsm(cfg.profile, cfg.device, getattr(torch, cfg.dtype), temp=max(cfg.temperature, 0.0),
                            seed=cfg.seed)
        specs = voice_files(cfg, self.tts)
        aliases = {alias: specs[target] for alias, target in cfg.aliases().items()}
        self.slots = DSMSlots(self.tts, cfg.num_slots, {**specs, **aliases}, "default",
                              cfg.dsm_cfg_coef, cfg.dsm_padding_between)
        self.voices = DSMVoices(self.slots.voices)
        self.mimi = self.tts.mimi
        self.decoder = SlotDecoder(self.mimi, cfg.num_slots)
        self.encoder = ClipEncoder(self.mimi, functools.partial(mimi_encode, self.mimi),
                                   functools.partial(mimi_encode_piece, self.mimi), cfg.encode_buckets,
                                   self.num_codebooks, self.device)
        self._rows: list[TTSStream | None] = [None] * cfg.num_slots
        self._waiting: deque[TTSStream] = deque()
        self._codes = torch.zeros(cfg.num_slots, self.num_codebooks, 1, dtype=torch.long)  # this step's, on the host

    # -- the contract's bookkeeping (rows, queue, cancel: StreamRows) ------------------------------
    def stats(self) -> dict[str, int]:
        return {"unseen_shape_calls": 0, "slow_calls": 0}  # nothing compiled: every step is the one shape

    def stream(self, text: str, context=None, speaker: str | None = None, reference=None, **_) -> TTSStream:
        """Queue ``text`` in voice ``speaker`` (a name; None: the default); it takes a row at a later step."""
        s = self.open(speaker, reference)
        self.say(s, text, final=True)
        return s

    def open(self, speaker: str | None = None, reference=None) -> TTSStream:
        """A stream in voice ``speaker`` whose text comes word by word (:meth:`say`): one reply's
        speech, its words joining as the LLM writes them. It takes a row at a later step."""
        self.voices.voice(speaker or "default", reference)
        if len(self._waiting) >= self.cfg.max_waiting:
            raise EngineBusy(f"all {self.num_slots} TTS slots are busy and {len(self._waiting)} streams wait")
        s = TTSStream(self, None, None, MAX_STEPS, 0, self.cfg.temperature)
        s.voice, s.said, s.starts, s.begun, s.ended = speaker or "default", [], [], 0, False
        self._waiting.append(s)
        return s

    def say(self, s: TTSStream, text: str, final: bool = False, clause: bool = True) -> None:
        """The stream's next words, whole (``final``: its last); ``clause``: they begin a clause (else
        they go on the one before). A clause begun with words is counted, and the chunk its audio
        begins with carries its index (``TTSStream.take_marked``)."""
        if s.ended:
            raise ValueError("this stream's last clause was already said")
        s.ended = final
        if s.closed:
            return
        if s.row is None:
            s.said.append((text, final, clause))  # it goes in when the stream takes a row
        else:
            self._say(s, text, final, clause)

    def _say(self, s: TTSStream, text: str, final: bool, clause: bool) -> None:
        if clause and text.strip():
            s.starts.append(self.slots.made(s.row))  # the entry its first word gets
        self.slots.push(s.row, text if final else text + " ", final)  # a space: its last word is whole

    def hungry(self, s: TTSStream) -> bool:
        """``s`` holds a row and waits for more words before it can go on (its text is not all in)."""
        return not s.ended and s.row is not None and not self.slots.ready(s.row)

    def has_work(self) -> bool:
        """A step would do something: a waiting stream can take a free row, or a row can go on (a
        row waiting for its next words does not step)."""
        return bool(self._waiting) and None in self._rows or any(self.slots.ready(r) for r in range(self.num_slots))

    # -- the step ---------------------------------------------------------------------------------
    @torch.inference_mode()
    def step(self) -> list[TTSStream]:
        """Free rows to the waiting streams, then one step of every row that can go on, its audio
        decoded in one Mimi call. Returns the streams that advanced."""
        self._admit()
        ran = self.slots.step()
        if not ran:
            return []
        audible = torch.zeros(self.num_slots, dtype=torch.bool)
        for r in ran:  # the frames are on the host already (DSMSlots reads the step's codes once)
            frames = self.slots.rows[r].frames
            if frames and self.slots.rows[r].steps > self.slots.gen.max_delay and (frames[-1] >= 0).all():
                self._codes[r, :, 0] = frames[-1]
                audible[r] = True
        pcm = None
        if audible.any():  # one copy to the device, one decode, one read back
            pcm = to_int16(self.decoder.decode(self._codes.to(self.device), audible.to(self.device)))
        advanced = []
        for r in ran:
            s = self._rows[r]
            if audible[r]:
                self._mark(s, len(self.slots.rows[r].frames) - 1)
                s._add_frame(self._codes[r, :, 0].numpy().copy(), pcm[r])
            s.generated = self.slots.rows[r].steps
            if self.slots.done(r) or self.slots.rows[r].steps >= MAX_STEPS:
                s._publish()
                s.finished = True
                self._release(s)
            advanced.append(s)
        return advanced

    def _mark(self, s: TTSStream, frame: int) -> None:
        """Before frame ``frame`` (its time, in frames) joins ``s``: the clauses whose audio begins by
        then (the step their first word went into the text, plus the model's audio delay; the first
        clause begins the first audible frame, the model's lead-in before its word with it)."""
        begun = None
        while s.begun < len(s.starts):
            took = self.slots.consumed_at(s.row, s.starts[s.begun])
            if s.begun and (took is None or took + self.tts.delay_steps > frame):
                break
            begun, s.begun = s.begun, s.begun + 1
        if begun is not None:
            s._begin_clause(begun)

    def _admit(self) -> None:
        while self._waiting and None in self._rows:
            s = self._waiting.popleft()
            r = self._rows.index(None)
            self.slots.open(r, s.voice)
            self._rows[r], s.row = s, r
            for text, final, clause in s.said:
                self._say(s, text, final, clause)
            s.said.clear()
            reset = torch.zeros(self.num_slots, dtype=torch.bool, device=self.device)
            reset[r] = True
            self.decoder.reset(reset)

    def _release(self, s: TTSStream) -> None:
        r = s.row
        if r is None:
            return
        self.slots.close(r)
        self._rows[r], s.row = None, None

    def warmup(self) -> None:
        """A short utterance through every path (admit, steps, decode, release) and an encode, once."""
        s = self.stream("Warm up.")
        while not s.finished:
            self.step()
        self.encoder.encode_user_audio(np.zeros(16_000, np.int16))
