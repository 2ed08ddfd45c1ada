"""What a server's engines offer a session beyond voice names: the languages it may choose (the
ones the recogniser hears, spoken by the session's voice), and whether it may bring its own
voice clip (CSM imitates one; DSM's voices are speaker embeddings and take none).

A session's ``language`` (an agent setting) is what its recogniser listens for and what its voice
must speak; None keeps the server's default (the recogniser's own: English for the English model,
detection for a multilingual one). A code is matched as the recogniser matches it: itself, or
its primary subtag ("fr-CA" where only "fr" is known); "auto" asks the recogniser to detect and
leaves the voice unchecked.

A server may serve both families at once, a family per voice: the offer then says which voices
take a clip (``word_voices``, DSM's, take none).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

from pipeline.engines import WordVoices, match_language

ENGLISH = ("en",)
AUTO = "auto"


class LanguageRefused(ValueError):
    """A language this server cannot serve, or a voice that does not speak the session's."""


def _primary(code: str) -> str:
    return code.split("-")[0].lower()


@dataclass(frozen=True)
class VoiceOffer:
    heard: tuple[str, ...] = ENGLISH  # the recogniser's codes
    spoken: Mapping[str, tuple[str, ...]] = field(default_factory=dict)  # voice -> its languages (absent: English)
    # The voices spoken by a family that takes words (DSM): speaker embeddings, which take no voice clip
    word_voices: WordVoices = WordVoices()

    def resolve(self, language: str) -> str:
        """The recogniser's code for ``language``; LanguageRefused when it does not hear it."""
        code = match_language(language, self.heard)
        if code is None:
            raise LanguageRefused(f"language {language!r} is not heard here; the recogniser hears {list(self.heard)}")
        return code

    def voice_languages(self, voice: str) -> tuple[str, ...]:
        return tuple(self.spoken.get(voice, ENGLISH))

    def check(self, language: str | None, voice: str) -> None:
        """LanguageRefused unless the recogniser hears ``language`` and ``voice`` speaks it (None: the
        server's default, always served)."""
        if language is None:
            return
        code = self.resolve(language)
        speaks = self.voice_languages(voice)
        if code != AUTO and _primary(code) not in {_primary(s) for s in speaks}:
            able = sorted(v for v in self.spoken if _primary(code) in {_primary(s) for s in self.spoken[v]})
            raise LanguageRefused(f"voice {voice!r} speaks {list(speaks)}, not {language!r}; "
                                  + (f"voices for it: {able}" if able else "no voice here speaks it"))

    def takes_clip(self, voice: str) -> bool:
        """Whether a session speaking with ``voice`` may send its own voice clip (CSM imitates one)."""
        return voice not in self.word_voices

    def describe(self) -> dict:
        """What a client reads of it (v1 ``session.ready``)."""
        return {"languages": list(self.heard), "voice_languages": {v: list(s) for v, s in self.spoken.items()}}
