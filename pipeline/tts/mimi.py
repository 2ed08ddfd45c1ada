"""Kyutai's Mimi codec (moshi package): 24 kHz audio <-> 32 codebooks at 12.5 Hz.

Never import ``moshi.server`` (it runs its ``main()`` on import); only ``moshi.models.loaders``.
"""
from __future__ import annotations

import copy
from contextlib import ExitStack

import numpy as np
import torch

NUM_CODEBOOKS = 32
MIMI_FILE = "tokenizer-e351c8d8-checkpoint125.safetensors"


def tiny_mimi_config() -> dict:
    """Mimi's real config with fewer SEANet filters and a 1-layer transformer (same rates, 32 x 2048 codes)."""
    from moshi.models import loaders

    cfg = copy.deepcopy(loaders._mimi_config)
    dim = 64
    cfg["seanet"].update(dimension=dim, n_filters=4)
    cfg["quantizer"].update(dimension=32, input_dimension=dim, output_dimension=dim)
    cfg["transformer"].update(d_model=dim, num_heads=2, num_layers=1, dim_feedforward=128,
                              input_dimension=dim, output_dimensions=[dim])
    return cfg


def load_mimi(profile: str, name_or_path: str = "kyutai/moshiko-pytorch-bf16", device: str = "cpu",
              seed: int = 0):
    """Mimi with 32 codebooks: the real checkpoint, or a tiny random one (``profile="tiny"``)."""
    from moshi.models import loaders

    if profile == "tiny":
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            mimi = loaders.get_mimi(None, mimi_config=tiny_mimi_config(), device=device, num_codebooks=NUM_CODEBOOKS)
            with torch.no_grad():  # untrained codebooks are all zeros: every frame would encode to code 0
                for name, buf in mimi.named_buffers():
                    if name.endswith("embedding_sum"):
                        buf.copy_(torch.randn_like(buf))
    elif profile == "full":  # the real architecture with random weights (benchmarks, no download)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            mimi = loaders.get_mimi(None, device=device, num_codebooks=NUM_CODEBOOKS)
            with torch.no_grad():
                for name, buf in mimi.named_buffers():
                    if name.endswith("embedding_sum"):
                        buf.copy_(torch.randn_like(buf))
    else:
        import os

        from pipeline.runtime.weights import reading_checkpoint, require_pretrained

        path = require_pretrained(name_or_path, what="Mimi", allow_patterns=[MIMI_FILE])
        if os.path.isdir(path):
            path = os.path.join(path, MIMI_FILE)
        with reading_checkpoint("Mimi", name_or_path, path):
            mimi = loaders.get_mimi(path, device=device, num_codebooks=NUM_CODEBOOKS)
    mimi.eval()
    warm_quantizer(mimi)
    return mimi


@torch.inference_mode()
def warm_quantizer(mimi) -> None:
    """Mimi's quantizer builds its embedding tables on first use: do it now, eagerly."""
    dev = next(mimi.parameters()).device
    codes = torch.zeros(1, NUM_CODEBOOKS, 1, dtype=torch.long, device=dev)
    mimi.decode_latent(codes)


def decode_streaming_modules(mimi) -> list:
    """The outermost streaming modules on Mimi's decode path (the encoder path stays stateless)."""
    return _streaming_modules(mimi.upsample, mimi.decoder_transformer, mimi.decoder)


def encode_streaming_modules(mimi) -> list:
    """The outermost streaming modules on Mimi's encode path (SEANet encoder, encoder transformer,
    downsample). Streaming them alone leaves an open decode stream untouched."""
    return _streaming_modules(mimi.encoder, mimi.encoder_transformer, mimi.downsample)


def _streaming_modules(*roots) -> list:
    from moshi.modules.streaming import StreamingModule

    found: list = []

    def visit(m) -> None:
        if isinstance(m, StreamingModule):
            found.append(m)
        else:
            for child in m.children():
                visit(child)

    for m in roots:
        if m is not None:
            visit(m)
    return found


class SlotDecoder:
    """Streaming Mimi decode of ``rows`` independent streams, one 80 ms frame per row per call.

    The decode path (upsample, decoder transformer, SEANet decoder) enters moshi's streaming mode
    with batch ``rows`` once, for the decoder's lifetime. Each call decodes a frame for every row;
    ``exec_mask`` (moshi's ``set_exec_mask``) says which rows really advance: the others' streaming
    state (convolution history, transformer cache and offsets) is left exactly as it was.
    :meth:`reset` (moshi's ``reset_streaming(reset_mask)``) clears the rows a new stream takes.
    The encode path stays stateless, so ``mimi.encode`` of user audio works meanwhile.
    One ``SlotDecoder`` per Mimi instance: the state lives in the modules.
    """

    def __init__(self, mimi, rows: int):
        self.mimi, self.rows = mimi, rows
        self.device = next(mimi.parameters()).device
        self.modules = decode_streaming_modules(mimi)
        self._stack: ExitStack | None = ExitStack()
        try:
            for m in self.modules:
                self._stack.enter_context(m.streaming(rows))
        except Exception:
            self.close()
            raise

    @torch.inference_mode()
    def reset(self, rows: torch.Tensor) -> None:
        """Fresh streaming state for the rows where ``rows`` ([R] bool) is True."""
        for m in self.modules:
            m.reset_streaming(rows)

    @torch.inference_mode()
    def decode(self, codes: torch.Tensor, exec_mask: torch.Tensor | None = None) -> torch.Tensor:
        """[rows, 32, n] codes -> [rows, n * 1920] float audio; rows off in ``exec_mask`` ([rows] bool
        on the device) keep their state (their output is meaningless)."""
        if self._stack is None:
            raise RuntimeError("decoder stream is closed")
        if exec_mask is not None:
            for m in self.modules:
                m.set_exec_mask(exec_mask)
        return self.mimi.decode(codes)[:, 0]

    def close(self) -> None:
        if self._stack is not None:
            stack, self._stack = self._stack, None
            stack.close()  # resets every streaming state to None


def to_int16(audio: torch.Tensor) -> np.ndarray:
    """Float audio in [-1, 1] (any device) -> contiguous int16 numpy."""
    pcm = (audio.float().clamp(-1.0, 1.0) * 32767.0).round().to(torch.int16)
    return np.ascontiguousarray(pcm.cpu().numpy())
