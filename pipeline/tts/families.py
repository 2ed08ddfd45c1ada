"""The voice families one server speaks with: one TTS (CSM or DSM), or both at once, a family per voice.

The serve config's ``tts:`` is one engine's settings, or a list of two of different families. The
first is the server's own: its "default" voice and the OpenAI voice names are its. The second
serves its named voices beside it (``voices``, and ``voice_aliases`` where set), each deployment
its own replicas: a session choosing one of them is spoken by that family, and a reply's mode
(a clause per stream, or one utterance fed word by word) follows the voice.
"""
from __future__ import annotations

from dataclasses import dataclass

from pipeline.engines import WordVoices
from pipeline.tts.config import TTSConfig


@dataclass(frozen=True)
class TTSFamilies:
    first: TTSConfig
    second: TTSConfig | None = None

    def __post_init__(self) -> None:
        if self.second is None:
            return
        if self.second.family == self.first.family:
            raise ValueError(f"tts: two {self.first.family} entries; one family's voices all go in one entry")
        own = self.own_names(self.second)
        if not own:
            raise ValueError(f"tts: the second entry ({self.second.family}) names no voice; it serves only its "
                             "named voices (voices:), the first entry's default stays the server's")
        clash = sorted(set(own) & set(self.first.voice_names()))
        if clash:
            raise ValueError(f"tts: voice names {clash} are in both entries (the first's include OpenAI's voice names "
                             "unless its voice_aliases says otherwise); each voice belongs to one family")

    @staticmethod
    def own_names(cfg: TTSConfig) -> tuple[str, ...]:
        """A second entry's voices: those it names, and its aliases where it sets them."""
        return tuple(sorted({*cfg.voices, *(cfg.voice_aliases or {})}))

    @property
    def configs(self) -> tuple[TTSConfig, ...]:
        return (self.first,) if self.second is None else (self.first, self.second)

    def names_of(self, cfg: TTSConfig) -> tuple[str, ...]:
        return cfg.voice_names() if cfg is self.first else self.own_names(cfg)

    def voice_names(self) -> tuple[str, ...]:
        """What a session may name as its voice."""
        return tuple(sorted({name for cfg in self.configs for name in self.names_of(cfg)}))

    def voice_languages(self) -> dict[str, tuple[str, ...]]:
        """Each voice a session may name, and the languages it speaks."""
        out: dict[str, tuple[str, ...]] = {}
        for cfg in self.configs:
            spoken = cfg.voice_languages()
            out.update({name: spoken[name] for name in self.names_of(cfg)})
        return out

    def words(self) -> TTSConfig | None:
        """The family that takes words (DSM), if served."""
        return next((cfg for cfg in self.configs if cfg.family == "dsm"), None)

    def word_voices(self) -> WordVoices:
        """The voices the family that takes words speaks: every one where it is the only family."""
        words = self.words()
        if words is None:
            return WordVoices()
        if self.second is None:
            return WordVoices(every=True)
        return WordVoices(frozenset(self.names_of(words)))

    @staticmethod
    def deployment_name(cfg: TTSConfig, first: bool) -> str:
        """``TTS`` for the first entry (as before), ``TTS_<family>`` for the second."""
        return "TTS" if first else f"TTS_{cfg.family}"
