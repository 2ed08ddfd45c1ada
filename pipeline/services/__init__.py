"""Async services around the engines: what a deployment serves, without the framework.

Each service owns an engine and the one :class:`InferenceThread` that runs all its model
calls: ``stt.py`` (:class:`STTService`), ``llm.py`` (:class:`LLMService`), ``tts.py``
(:class:`TTSService`). Ray deployments (``deployments/``) are thin adapters over these;
``local.py`` (:class:`LocalBackends`) wires them in-process for tests and tools that run without Ray.
"""
from pipeline.services.llm import LLMService, load_llm
from pipeline.services.local import LocalBackends
from pipeline.services.stt import STTService, load_stt
from pipeline.services.tts import TTSService, load_tts

__all__ = ["LLMService", "LocalBackends", "STTService", "TTSService", "load_llm", "load_stt", "load_tts"]
