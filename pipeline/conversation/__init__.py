"""The conversation core: one conversation, whatever the wire (docs/conversation.md).

- ``core.py``: :class:`Conversation`, typed commands in (``commands.py``) through ``do``, typed
  events out (``events.py``) through one ``emit``; the turn flow, deadlines, resume.
- ``user_turns.py``: user turns as they end, and the replies they or the client ask for.
- ``turns.py``: :class:`TurnTaker`: the ears (``ears/``: echo cancellation, VAD, Smart Turn, the
  recogniser's stream) and the audio allowance; it decides when a turn is over.
- ``replies.py``: the replies and the response lifecycle; ``reply.py``: one reply (LLM -> clauses
  -> TTS -> paced audio), ``synthesis.py`` its clauses through the TTS, ``dead_air.py`` the gaps in
  its audio and their causes; ``tools.py``: tool calls and what follows them.
- ``playback.py``: what the client played; ``keypad.py``: the keys a caller pressed.
- ``items.py``: the history's edits; ``configurator.py``: settings changed as one.
- ``history.py``, ``agent.py``, ``calls.py``, ``clauses.py``, ``allowance.py``,
  ``speculation.py``, ``voice_context.py``, ``snapshot.py``: the parts they use; ``shared.py``:
  what the parts share; ``observer.py``: what the metrics hear.
"""
from pipeline.conversation.core import Conversation
from pipeline.conversation.refusal import Refusal

__all__ = ["Conversation", "Refusal"]
