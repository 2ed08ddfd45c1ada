"""What every part of one conversation reads and writes: its settings, history and TTS context,
the turn count, and the way out to its client."""
from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Callable

from pipeline.conversation.agent import AgentSettings
from pipeline.conversation.voice_offer import VoiceOffer
from pipeline.conversation.events import Emit, Error
from pipeline.conversation.observer import Observer
from pipeline.conversation.voice_context import VoiceContext
from pipeline.engines import Backends
from pipeline.conversation.history import History
from pipeline.session_config import SessionConfig


@dataclass
class Shared:
    id: str
    backends: Backends
    emit: Emit
    observer: Observer
    clock: Callable[[], float]  # monotonic seconds (tests drive a fake one)
    voices: tuple[str, ...]  # the voices a session may choose (configured on the TTS replica)
    cfg: SessionConfig
    history: History
    context: VoiceContext
    agent: AgentSettings = field(default_factory=AgentSettings)
    offer: VoiceOffer = field(default_factory=VoiceOffer)  # the languages and voice clips a session may choose
    turn: int = 0  # number of the last user turn that ended
    reply_on_turn_end: bool = True  # a turn the server ended gets its reply (Realtime: create_response)
    # Set whenever what a resumed conversation would start from changed (pipeline/resume/keeper.py)
    changed: asyncio.Event = field(default_factory=asyncio.Event)

    async def error(self, code: str, message: str) -> None:
        self.observer.error(code)
        await self.emit(Error(code, message))
