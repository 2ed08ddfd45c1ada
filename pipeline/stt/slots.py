"""What the recogniser keeps per slot, typed: the device state every slot owns a row of
(:class:`SlotState`, in the style of moshi's ``StreamingModule`` state: one object per engine,
reset by rows), and the host's bookkeeping of the stream a slot serves (:class:`SlotStream`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch


@dataclass
class STTEvent:
    stream_id: str
    kind: str  # "partial" (text = delta) | "endpoint" | "final" (text = the whole utterance, after end())
    text: str = ""
    tokens: Optional[list[int]] = None  # "final" only
    words: Optional[list[dict]] = None  # "final" only: [{"word", "start_ms", "end_ms"}]


@dataclass
class SlotState:
    """The device state of every slot, a row each: the encoder's caches ([L, slot, ...] each:
    projected keys/values and conv inputs, or NeMo's cache_last_channel/time) and their length,
    the mel pre-encode cache, and the prediction network's LSTM state (h of each layer, then c)
    and projected output. A fresh row holds the start state: zero caches, silent mel, and the
    prediction network after <SOS> (``hc0``, ``g0``), as NeMo starts."""

    caches: list[torch.Tensor]
    cache_len: torch.Tensor  # [slot]
    mel_cache: torch.Tensor  # [slot, features, pre_cache]
    hc: torch.Tensor  # [2L, slot, H]
    g: torch.Tensor  # [slot, joint hidden]
    hc0: torch.Tensor  # [2L, H]: the start state
    g0: torch.Tensor  # [joint hidden]
    mel_zero: float
    prompt: torch.Tensor  # [slot]: the language prompt index of a language-prompted model (else unused)

    @classmethod
    def create(cls, cache_shapes, num_slots: int, features: int, pre_cache: int, pred, joint, blank: int,
               mel_zero: float, dtype: torch.dtype, device: torch.device) -> "SlotState":
        S = num_slots
        caches = [torch.zeros((shape[0], S, *shape[2:]), dtype=dtype, device=device) for shape in cache_shapes]
        hc = torch.zeros(2 * pred.num_layers, S, pred.hidden, dtype=dtype, device=device)
        with torch.inference_mode():  # after <SOS> (= blank, a zero embedding) into a zero LSTM state
            g0, hc0 = pred(torch.full((1,), blank, dtype=torch.long, device=device), hc[:, :1].clone())
            g0 = joint.project_prednet(g0)[0]
        state = cls(caches, torch.zeros(S, dtype=torch.long, device=device),
                    torch.full((S, features, pre_cache), mel_zero, dtype=dtype, device=device),
                    hc, g0.expand(S, -1).clone(), hc0[:, 0], g0, mel_zero,
                    torch.zeros(S, dtype=torch.long, device=device))
        state.hc[:] = state.hc0[:, None]
        return state

    @torch.inference_mode()
    def reset(self, rows: torch.Tensor) -> None:
        """The start state in ``rows`` (their language prompt stays: it is the stream's, set by open)."""
        for cache in self.caches:
            cache[:, rows] = 0
        self.cache_len[rows] = 0
        self.mel_cache[rows] = self.mel_zero
        self.hc[:, rows] = self.hc0[:, None]
        self.g[rows] = self.g0

    @torch.inference_mode()
    def copy(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Rows ``src`` into rows ``dst``."""
        for cache in self.caches:
            cache[:, dst] = cache[:, src]
        self.cache_len[dst] = self.cache_len[src]
        self.mel_cache[dst] = self.mel_cache[src]
        self.hc[:, dst] = self.hc[:, src]
        self.g[dst] = self.g[src]
        self.prompt[dst] = self.prompt[src]


class SlotStream:
    """The host's bookkeeping of the stream one slot serves: audio not yet consumed, the tokens of
    the utterance and when each was emitted, what was told of them."""

    def __init__(self, stream_id: str, slot: int):
        self.id = stream_id
        self.slot = slot
        self.reset()

    def reset(self) -> None:
        self.buf = np.zeros(0, np.float32)
        self.buf_start = 0  # absolute sample index of buf[0]
        self.total = 0  # samples fed this utterance
        self.next_frame = 0  # next mel frame to encode
        self.enc_frames = 0  # encoder frames decoded this utterance
        self.tokens: list[int] = []
        self.token_frames: list[int] = []  # encoder frame (from the utterance start) of each token
        self.text = ""
        self.last_token_frame = -1
        self.endpointed = False
        self.ending = False  # end() called: the next step decodes the remainder as the last chunk

    def forked(self, stream_id: str, slot: int) -> "SlotStream":
        """A copy of this stream as it is now, under another id and slot."""
        copy = SlotStream(stream_id, slot)
        copy.__dict__.update({k: v for k, v in vars(self).items() if k not in ("id", "slot")})
        copy.buf, copy.tokens, copy.token_frames = self.buf.copy(), list(self.tokens), list(self.token_frames)
        return copy

    def record(self, labels: np.ndarray, frames: np.ndarray, n_frames: int) -> None:
        """Take one chunk's decoding: labels (-1: none) with their frames in the chunk, and the
        chunk's encoder frame count."""
        emitted = labels >= 0
        if emitted.any():
            self.tokens.extend(int(v) for v in labels[emitted])
            self.token_frames.extend(self.enc_frames + int(v) for v in frames[emitted])
            self.last_token_frame = self.enc_frames + int(frames[emitted][-1])
            self.endpointed = False
        self.enc_frames += n_frames

    def events(self, text_of, endpoint_ms: float | None, frame_ms: int) -> list[STTEvent]:
        """What the last chunk changed: the text's new part (``text_of(tokens)``), and an endpoint
        after ``endpoint_ms`` of blank output."""
        events = []
        if self.tokens:
            text = text_of(self.tokens)
            if text != self.text:
                delta = text[len(self.text):] if text.startswith(self.text) else text
                self.text = text
                if delta:
                    events.append(STTEvent(self.id, "partial", delta))
        if endpoint_ms is not None and self.tokens and not self.endpointed:
            if (self.enc_frames - 1 - self.last_token_frame) * frame_ms >= endpoint_ms:
                self.endpointed = True
                events.append(STTEvent(self.id, "endpoint", ""))
        return events
