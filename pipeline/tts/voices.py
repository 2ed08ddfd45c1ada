"""The voices a TTS engine speaks: each a CSM speaker id and, optionally, a reference clip (its
codes and transcript) that leads the prompts, encoded once at warm-up in warmed shapes. OpenAI's
voice names (and any configured alias) speak as the voice they alias."""
from __future__ import annotations

import logging
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from pipeline.tts.config import TTSConfig
from pipeline.tts.prompt import BOT_SPEAKER, Segment

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class VoiceProfile:
    """A voice as the engine speaks it: the CSM speaker id of its text and turns, and the reference
    clip (codes and transcript) that leads its prompts."""

    speaker: int
    reference: Segment | None = None


def clip_path(clip: str) -> Path:
    """A voice clip's file: as given if absolute, else from the working directory, else from the
    clips that ship with the package (pipeline/tts/voices links to the repository's voices/)."""
    path = Path(clip)
    if path.is_absolute() or path.exists():
        return path
    return Path(str(resources.files("pipeline.tts") / path))


class Voices:
    def __init__(self, cfg: TTSConfig):
        self.cfg = cfg
        self.profiles = {name: VoiceProfile(spec.get("speaker", 0)) for name, spec in cfg.voice_specs().items()}
        self.aliases = cfg.aliases()

    def voice(self, name: str = "default", reference: Segment | None = None) -> VoiceProfile:
        """The voice ``name`` (or an alias of one), with the session's own ``reference`` clip in place
        of its configured one when given; raises KeyError for a name this engine does not have."""
        profile = self.profiles[self.aliases.get(name, name)]
        reference = profile.reference if reference is None else reference
        if reference is not None and reference.speaker != profile.speaker:
            reference = Segment(profile.speaker, reference.text, reference.codes)
        return VoiceProfile(profile.speaker, reference)

    @staticmethod
    def context(profile: VoiceProfile, context: list[Segment] | None) -> list[Segment]:
        """A session's context as ``profile`` speaks it: the bot's turns carry the voice's speaker id."""
        if profile.speaker == BOT_SPEAKER:
            return list(context or [])
        return [Segment(profile.speaker, s.text, s.codes) if s.speaker == BOT_SPEAKER else s for s in context or []]

    def encode_clips(self, encode_audio) -> None:
        """Each configured voice's clip, encoded once (``encode_audio(pcm, rate)``: warmed buckets)
        and kept as its reference."""
        from pipeline.audio import read_wav

        for name, spec in self.cfg.voice_specs().items():
            if spec.get("clip") is None:
                continue
            pcm, rate = read_wav(str(clip_path(spec["clip"])))
            codes = encode_audio(pcm, rate)
            speaker = self.profiles[name].speaker
            self.profiles[name] = VoiceProfile(speaker, Segment(speaker, spec["text"].strip(), codes))
            log.info("voice %s: %.1f s clip -> %d frames", name, len(pcm) / rate, len(codes))
