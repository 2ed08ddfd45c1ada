"""The conversation core: one conversation, whatever the wire.

- ``core.py``: :class:`Conversation`, typed commands in (``commands.py``), typed events out
  (``events.py``) through one ``emit``; history, settings, items, deadlines, resume.
- ``turns.py``: :class:`TurnTaker`: the ears (echo cancellation, VAD), the recogniser's slot,
  Smart Turn and the audio allowance; it decides when a turn is over.
- ``replies.py``: the replies and the response lifecycle; ``reply.py``: one reply (LLM -> clauses
  -> TTS -> paced audio); ``tools.py``: tool calls and what follows them.
- ``voice_context.py``: the TTS's context; ``shared.py``: what the parts share;
  ``observer.py``: what the metrics hear.
"""
from pipeline.conversation.core import Conversation
from pipeline.conversation.refusal import Refusal

__all__ = ["Conversation", "Refusal"]
