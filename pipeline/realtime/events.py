"""The Realtime protocol's server events and conversation items, as JSON-ready dicts (GA names).

Builders only: :class:`pipeline.realtime.session.RealtimeSession` decides when each goes out,
adds its ``event_id`` and, for a beta client (``OpenAI-Beta: realtime=v1``), renames it
(:data:`BETA_NAMES`). Shapes follow OpenAI's GA reference as its own SDKs parse them (the Agents
SDK validates every event: each field here that it requires is always present).
"""
from __future__ import annotations

from typing import Any

from pipeline.history import Item

# GA event name -> the beta name an older client expects (the cheap aliases; docs/realtime.md)
BETA_NAMES = {
    "response.output_audio.delta": "response.audio.delta",
    "response.output_audio.done": "response.audio.done",
    "response.output_audio_transcript.delta": "response.audio_transcript.delta",
    "response.output_audio_transcript.done": "response.audio_transcript.done",
    "response.output_text.delta": "response.text.delta",
    "response.output_text.done": "response.text.done",
    "conversation.item.added": "conversation.item.created",
}
# GA content part type -> beta
BETA_PARTS = {"output_audio": "audio", "output_text": "text"}

# Error types and the codes this server gives (docs/realtime.md lists them)
INVALID_REQUEST = "invalid_request_error"
SERVER_ERROR = "server_error"


def error(kind: str, code: str, message: str, param: str | None = None, event_id: str | None = None) -> dict:
    return {"type": "error", "error": {"type": kind, "code": code, "message": message, "param": param,
                                       "event_id": event_id}}


def item(it: Item, status: str = "completed") -> dict:
    """A history item as a Realtime conversation item (no audio bytes: transcripts only)."""
    if it.kind == "function_call":
        return {"id": it.id, "object": "realtime.item", "type": "function_call", "status": status,
                "call_id": it.call_id, "name": it.name, "arguments": it.arguments if status == "completed" else ""}
    if it.kind == "function_call_output":
        return {"id": it.id, "object": "realtime.item", "type": "function_call_output", "status": status,
                "call_id": it.call_id, "output": it.text}
    if it.role == "user":
        part = {"type": "input_audio", "transcript": it.text} if it.audio else {"type": "input_text", "text": it.text}
    elif it.audio:
        part = {"type": "output_audio", "transcript": it.text}
    else:
        part = {"type": "output_text", "text": it.text}
    return {"id": it.id, "object": "realtime.item", "type": "message", "role": it.role, "status": status,
            "content": [part]}


def reply_item(item_id: str, speaks: bool, transcript: str | None, status: str) -> dict:
    """The assistant message a reply makes; content empty while it is still to come."""
    content = [] if transcript is None else [
        {"type": "output_audio", "transcript": transcript} if speaks else {"type": "output_text", "text": transcript}]
    return {"id": item_id, "object": "realtime.item", "type": "message", "role": "assistant", "status": status,
            "content": content}


def response(response_id: str, status: str, output: list[dict], modalities: list[str], voice: str,
             output_format: dict, max_output_tokens: Any, metadata: dict | None = None,
             status_details: dict | None = None, usage: dict | None = None) -> dict:
    return {"id": response_id, "object": "realtime.response", "status": status, "status_details": status_details,
            "output": output, "conversation_id": None, "output_modalities": modalities,
            "max_output_tokens": max_output_tokens, "audio": {"output": {"format": output_format, "voice": voice}},
            "usage": usage, "metadata": metadata}


def usage(input_tokens: int, output_tokens: int) -> dict:
    return {"total_tokens": input_tokens + output_tokens, "input_tokens": input_tokens, "output_tokens": output_tokens,
            "input_token_details": {"text_tokens": input_tokens, "audio_tokens": 0, "cached_tokens": 0},
            "output_token_details": {"text_tokens": output_tokens, "audio_tokens": 0}}


def beta(event: dict) -> dict:
    """An event renamed (and its content parts retyped) for a beta client."""
    event = dict(event)
    event["type"] = BETA_NAMES.get(event["type"], event["type"])
    it = event.get("item")
    if isinstance(it, dict) and it.get("content"):
        event["item"] = dict(it, content=[dict(p, type=BETA_PARTS.get(p.get("type"), p.get("type")))
                                          for p in it["content"]])
    return event
