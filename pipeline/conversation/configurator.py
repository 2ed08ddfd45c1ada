"""A session's settings changed as one: turn taking (SessionConfig fields), the agent
(AgentSettings fields), whether a turn the server ends gets a reply, and the session's own voice
clip, every one checked (and the clip encoded) before any applies."""
from __future__ import annotations

import dataclasses
from typing import Any

from pipeline.conversation.agent import MAX_VOICE_CLIP_S, MAX_VOICE_CLIP_TEXT, AgentSettings, BadSetting
from pipeline.audio_constants import REPLY_RATE
from pipeline.conversation import commands as C
from pipeline.conversation.refusal import Refusal
from pipeline.conversation.shared import Shared
from pipeline.conversation.turns import TurnTaker
from pipeline.engines import BOT_SPEAKER, EngineUnavailable, Segment, bounded
from pipeline.errors import E_ENGINE_UNAVAILABLE


class Configurator:
    def __init__(self, shared: Shared, turns: TurnTaker):
        self.shared, self.turns = shared, turns

    async def configure(self, turn_taking: dict[str, Any] | None = None, agent: dict[str, Any] | None = None,
                        reply_on_turn_end: bool | None = None, voice_clip: C.VoiceClip | None = None) -> AgentSettings:
        """Change the session's settings, every one checked (and a voice clip encoded) before any
        applies. A new voice starts the bot's side of the TTS context afresh."""
        s, changes = self.shared, dict(agent or {})
        cfg = dataclasses.replace(s.cfg, **turn_taking) if turn_taking else s.cfg
        settings = s.agent.updated(changes, s.voices, s.offer)
        if voice_clip is not None:
            changes["voice_reference"] = await self._encode_clip(voice_clip, settings.voice)
            settings = s.agent.updated(changes, s.voices, s.offer)
        self.turns.configure(cfg)
        s.cfg = cfg
        s.history.max_chars = cfg.max_history_chars  # applies from the next item added
        if settings.tts_voice() != s.agent.tts_voice():
            s.context.drop_bot()
        s.agent = settings
        if reply_on_turn_end is not None:
            s.reply_on_turn_end = reply_on_turn_end
        s.changed.set()
        return settings

    async def _encode_clip(self, clip: C.VoiceClip, voice: str) -> Segment:
        """A session's own reference clip -> its context segment (a bucketed encode: never a new
        shape on the TTS replica)."""
        if not self.shared.offer.takes_clip(voice):
            raise BadSetting("voice_clip", f"voice {voice!r} takes no voice clip (it is a speaker embedding: "
                                           "choose a voice by its name)")
        text = clip.text.strip()
        if not text or len(text) > MAX_VOICE_CLIP_TEXT:
            raise BadSetting("voice_clip", f"a voice clip needs its transcript, of at most {MAX_VOICE_CLIP_TEXT} "
                                           "characters")
        if not len(clip.pcm) or len(clip.pcm) > MAX_VOICE_CLIP_S * REPLY_RATE:
            raise BadSetting("voice_clip", f"a voice clip holds up to {MAX_VOICE_CLIP_S:g} s of audio (pcm16 at "
                                           f"{REPLY_RATE} Hz); this one has {len(clip.pcm) / REPLY_RATE:.1f} s")
        try:
            codes = await bounded(self.shared.backends.tts_encode(clip.pcm, REPLY_RATE), self.shared.cfg.engine_timeout_s)
        except EngineUnavailable as exc:
            raise Refusal(E_ENGINE_UNAVAILABLE, f"the voice clip could not be encoded ({exc})", "voice_clip") from None
        return Segment(BOT_SPEAKER, text, codes)
