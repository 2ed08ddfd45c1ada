"""End of turn from the audio itself: Smart Turn v3.2 (the ONNX model shipped in the ``pipecat-ai`` wheel).

The model reads the last 8 s of a turn's 16 kHz audio (left-padded with zeros) as Whisper
log-mel features (80 bins x 800 frames, normalised) and gives the probability that the speaker
has finished. The features come from pipecat's own numpy port of
``transformers.WhisperFeatureExtractor`` (the extractor its model card names), so the
probability is exactly what pipecat's ``LocalSmartTurnAnalyzerV3`` computes: the model is
sensitive enough that transformers' float rounding (features within 3e-5) moved one clip's
probability from 0.107 to 0.067. One :class:`SmartTurn` per process; calls (~25 ms on one CPU thread) run on its own
single worker thread, so they never block the event loop and never take more than one core.
``tests/test_turn_taking.py`` checks the probability against pipecat's own analyzer.
"""
from __future__ import annotations

import asyncio
import functools
import importlib.util
import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from pipeline.audio_constants import USER_RATE

SECONDS = 8
MODEL_FILE = "smart-turn-v3.2-cpu.onnx"


def model_path() -> str:
    """The model file inside the installed pipecat-ai package, found without importing pipecat
    (its ``__init__`` pulls in much that this never uses)."""
    spec = importlib.util.find_spec("pipecat")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("Smart Turn needs the pipecat-ai package (scripts/install.sh installs it)")
    path = os.path.join(spec.submodule_search_locations[0], "audio", "turn", "smart_turn", "data", MODEL_FILE)
    if not os.path.exists(path):
        raise RuntimeError(f"pipecat-ai is installed but has no {MODEL_FILE} at {path}")
    return path


class SmartTurn:
    def __init__(self, path: str | None = None):
        import onnxruntime as ort
        from pipecat.audio.turn.smart_turn._whisper_features import compute_whisper_log_mel_features

        opts = ort.SessionOptions()
        opts.intra_op_num_threads = 1
        opts.inter_op_num_threads = 1
        opts.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        self._session = ort.InferenceSession(path or model_path(), sess_options=opts,
                                             providers=["CPUExecutionProvider"])
        self._features = compute_whisper_log_mel_features
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="smart-turn")

    def probability(self, pcm: np.ndarray) -> float:
        """P(the turn is complete) for a turn's int16 16 kHz audio (its last 8 s count)."""
        audio = np.asarray(pcm, np.float32)[-USER_RATE * SECONDS:] / 32768.0
        audio = np.pad(audio, (USER_RATE * SECONDS - len(audio), 0))
        x = self._features(audio, do_normalize=True)[None].astype(np.float32)
        (out,) = self._session.run(None, {"input_features": x})
        return float(np.asarray(out).reshape(-1)[0])

    async def probability_async(self, pcm: np.ndarray) -> float:
        return await asyncio.get_running_loop().run_in_executor(self._worker, self.probability, pcm)


@functools.cache
def shared_model() -> SmartTurn:
    return SmartTurn()
