"""Streaming speech recognition: cache-aware FastConformer RNNT with continuous batching."""
from pipeline.stt.config import STTConfig
from pipeline.stt.engine import NoFreeSlot, STTEngine, STTEvent  # noqa: F401

__all__ = ["STTConfig", "STTEngine", "STTEvent", "NoFreeSlot"]
