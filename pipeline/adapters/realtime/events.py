"""The Realtime protocol's server events and conversation items, as JSON-ready dicts (GA names).

Builders only: :class:`pipeline.adapters.realtime.adapter.RealtimeSession` decides when each goes out,
adds its ``event_id`` and, for a beta client (``OpenAI-Beta: realtime=v1``), renames it
(:data:`BETA_NAMES`). Shapes follow OpenAI's GA reference as its own SDKs parse them (the Agents
SDK validates every event: each field here that it requires is always present).
"""
from __future__ import annotations

from typing import Any

from pipeline.conversation.history import Item

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


# Sequences: what one thing the conversation did looks like on this wire, in order.
def items_added(it: dict, previous: str | None) -> list[dict]:
    return [{"type": "conversation.item.added", "previous_item_id": previous, "item": it},
            {"type": "conversation.item.done", "previous_item_id": previous, "item": it}]


def user_turn(it: Item, previous: str | None, transcription: bool, seconds: float) -> list[dict]:
    """A user item joined the conversation; with transcription on, its transcript follows."""
    events = items_added(item(it), previous)
    if transcription:
        if it.text:
            events.append({"type": "conversation.item.input_audio_transcription.delta", "item_id": it.id,
                           "content_index": 0, "delta": it.text})
        events.append({"type": "conversation.item.input_audio_transcription.completed", "item_id": it.id,
                       "content_index": 0, "transcript": it.text,
                       "usage": {"type": "duration", "seconds": round(seconds, 3)}})
    return events


def at(response_id: str, item_id: str) -> dict:
    return {"response_id": response_id, "item_id": item_id, "output_index": 0, "content_index": 0}


def reply_opened(response_id: str, item_id: str, speaks: bool, previous: str | None) -> list[dict]:
    """A reply's assistant item and its content part, opened."""
    started = reply_item(item_id, speaks, None, "in_progress")
    part = {"type": "audio", "transcript": ""} if speaks else {"type": "text", "text": ""}
    return [{"type": "response.output_item.added", "response_id": response_id, "output_index": 0, "item": started},
            {"type": "conversation.item.added", "previous_item_id": previous, "item": started},
            {"type": "response.content_part.added", **at(response_id, item_id), "part": part}]


def reply_closed(response_id: str, item_id: str, speaks: bool, transcript: str, status: str,
                 audio_tail: str | None) -> tuple[list[dict], dict]:
    """A reply's content and item, closed: the events and the item as the response lists it."""
    where, events = at(response_id, item_id), []
    if speaks:
        if audio_tail:
            events.append({"type": "response.output_audio.delta", **where, "delta": audio_tail})
        events += [{"type": "response.output_audio.done", **where},
                   {"type": "response.output_audio_transcript.done", **where, "transcript": transcript}]
        part = {"type": "audio", "transcript": transcript}
    else:
        events.append({"type": "response.output_text.done", **where, "text": transcript})
        part = {"type": "text", "text": transcript}
    closed = reply_item(item_id, speaks, transcript, status)
    events += [{"type": "response.content_part.done", **where, "part": part},
               {"type": "conversation.item.done", "previous_item_id": None, "item": closed},
               {"type": "response.output_item.done", "response_id": response_id, "output_index": 0, "item": closed}]
    return events, closed


def function_call(response_id: str, output_index: int, it: Item, previous: str | None) -> list[dict]:
    """A function call of a running response, whole (its arguments in one delta)."""
    where = {"response_id": response_id, "output_index": output_index}
    args = {**where, "item_id": it.id, "call_id": it.call_id}
    return [{"type": "response.output_item.added", **where, "item": item(it, "in_progress")},
            {"type": "conversation.item.added", "previous_item_id": previous, "item": item(it, "in_progress")},
            {"type": "response.function_call_arguments.delta", **args, "delta": it.arguments},
            {"type": "response.function_call_arguments.done", **args, "name": it.name, "arguments": it.arguments},
            {"type": "conversation.item.done", "previous_item_id": previous, "item": item(it)},
            {"type": "response.output_item.done", **where, "item": item(it)}]


def status_details(status: str, reason: str | None) -> dict | None:
    return {"completed": None, "cancelled": {"type": "cancelled", "reason": reason},
            "incomplete": {"type": "incomplete", "reason": reason},
            "failed": {"type": "failed", "error": {"type": SERVER_ERROR, "code": reason}}}[status]
