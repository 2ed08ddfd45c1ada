"""Streaming TTS: Sesame CSM generates 32-codebook Mimi frames, Kyutai's Mimi decodes them to 24 kHz PCM.

``TTSEngine`` and ``TTSStream`` (in :mod:`pipeline.tts.engine`) import torch; they load lazily here.
"""
from pipeline.tts.config import TTSConfig
from pipeline.tts.prompt import Segment

__all__ = ["TTSConfig", "Segment", "TTSEngine", "TTSStream"]


def __getattr__(name: str):
    if name in ("TTSEngine", "TTSStream"):
        from pipeline.tts import engine

        return getattr(engine, name)
    raise AttributeError(name)
