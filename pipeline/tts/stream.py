"""One utterance of the TTS engine (``pipeline/tts/engine.py``), as its consumer reads it: chunks of
int16 mono 24 kHz audio with the Mimi codes that made them."""
from __future__ import annotations

import time
from collections import deque
import numpy as np


class TTSStream:
    """One utterance: int16 mono 24 kHz chunks with the Mimi codes that made them.

    The first chunk covers ``first_chunk_frames`` frames, each later one ``chunk_frames`` (the last
    may be shorter). Iterating steps the engine until this stream has a chunk (other streams
    advance too); a server instead steps the engine in a loop and calls :meth:`take`.
    ``.codes`` ([frames, 32] int64) and ``.frames`` hold the frames whose audio has been taken so
    far (all of them once the iteration ends). ``close()`` ends it early and frees its slot.
    ``engine``: the TTSEngine that steps it.

    A stream fed clause by clause (DSM's :meth:`~pipeline.tts.dsm.engine.DSMEngine.say`) marks the
    chunk each clause's audio begins with: :meth:`take_marked` gives the index of the last clause
    begun in it (clauses counted from 0, empty ones not counted), None in a chunk that begins none.
    """

    def __init__(self, engine, tokens: np.ndarray, mask: np.ndarray, max_frames: int,
                 seed: int, temperature: float):
        self._engine = engine
        self.prompt_tokens, self.prompt_mask = tokens, mask
        self.max_frames, self.seed, self.temperature = max_frames, seed, temperature
        self.row: int | None = None  # the slot, while the stream holds one
        self.generated = 0  # frames generated so far
        self.finished = False  # no chunk will be published any more
        self.closed = False  # cancelled by the consumer
        self.timings: dict[str, float] = {}
        self._opened_at = time.perf_counter()
        self._ready: deque[tuple[np.ndarray, np.ndarray, int | None]] = deque()  # published, not yet taken
        self._mark: int | None = None  # the clause the next published chunk begins
        self._pcm: list[np.ndarray] = []  # frames since the last published chunk
        self._frame_codes: list[np.ndarray] = []
        self._published = 0
        self._taken: list[np.ndarray] = []

    # -- consumer side ------------------------------------------------------------------------------
    def take(self) -> tuple[np.ndarray, np.ndarray] | None:
        """The next published chunk and its codes ([n, 32]), or None if none is ready."""
        item = self.take_marked()
        return None if item is None else item[1:]

    def take_marked(self) -> tuple[int | None, np.ndarray, np.ndarray] | None:
        """The next published chunk as (its clause mark, pcm, codes), or None if none is ready."""
        try:
            pcm, codes, mark = self._ready.popleft()
        except IndexError:
            return None
        self._taken.append(codes)
        return mark, pcm, codes

    def __iter__(self) -> "TTSStream":
        return self

    def __next__(self) -> np.ndarray:
        while True:
            item = self.take()
            if item is not None:
                return item[0]
            if self.finished:
                raise StopIteration
            self._engine.step()

    @property
    def codes(self) -> np.ndarray:
        if not self._taken:
            return np.zeros((0, self._engine.num_codebooks), dtype=np.int64)
        return np.concatenate(self._taken)

    @property
    def frames(self) -> int:
        return sum(len(c) for c in self._taken)

    def close(self) -> None:
        """Stop generating and free the slot (idempotent; on the inference thread)."""
        self._engine.cancel(self)

    # -- engine side (inference thread) ----------------------------------------------------------------
    def _add_frame(self, codes: np.ndarray, pcm: np.ndarray) -> None:
        cfg = self._engine.cfg
        self._frame_codes.append(codes)
        self._pcm.append(pcm)
        self.generated += 1
        if len(self._pcm) >= (cfg.first_chunk_frames if self._published == 0 else cfg.chunk_frames):
            self._publish()

    def _begin_clause(self, index: int) -> None:
        """The next frame is the first of clause ``index``: it begins a chunk of its own."""
        self._publish()
        self._mark = index

    def _publish(self) -> None:
        if not self._pcm:
            return
        self._ready.append((np.concatenate(self._pcm), np.stack(self._frame_codes).astype(np.int64), self._mark))
        self._pcm, self._frame_codes, self._mark = [], [], None
        self._published += 1
        self.timings.setdefault("first_chunk_s", time.perf_counter() - self._opened_at)


class StreamRows:
    """What an engine keeps of its streams, whatever its model: the one in each row (slot) of its
    batch, ``_rows`` (None: free), and those waiting for a row, ``_waiting`` (first come, first
    served). The engine sets both and releases a row with its own ``_release``."""

    _rows: list[TTSStream | None]
    _waiting: deque

    @property
    def active_requests(self) -> int:
        """Streams opened and not yet finished or closed (with a slot, or waiting for one)."""
        return self.busy_slots + len(self._waiting)

    @property
    def busy_slots(self) -> int:
        """Slots a stream holds."""
        return sum(s is not None for s in self._rows)

    def has_work(self) -> bool:
        return bool(self._waiting) or self.busy_slots > 0

    def cancel(self, s: TTSStream) -> None:
        """End ``s`` now: it leaves the waiting line or frees its row before the next step."""
        if s.closed:
            return
        s.closed = s.finished = True
        if s.row is not None:
            self._release(s)
        elif s in self._waiting:
            self._waiting.remove(s)
