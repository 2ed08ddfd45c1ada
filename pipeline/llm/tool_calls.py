"""Tool calls in a model's own text: the Hermes / Qwen2.5 format, parsed as it streams.

A model that calls a tool writes ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``
(Qwen2.5's chat template teaches it this; vLLM calls the format "hermes"). :class:`ToolCallParser`
turns a text stream into text deltas and :class:`~pipeline.engines.ToolCall` events, holding back
only what could be the start of a tag, so text before a call is spoken as it comes.

:func:`call_schema` is the JSON schema of one call to the given tools; :func:`forced_call_grammar`
wraps it in the tags as a grammar for llguidance, which the engine uses to force a call
(``tool_choice`` ``required`` or a named function): the arguments then always parse and validate.
:func:`template_messages` turns the conversation's OpenAI-format messages into what chat
templates take (a tool call's arguments as a mapping).
"""
from __future__ import annotations

import json
import logging
import uuid
from typing import Any

from pipeline.engines import ToolCall

OPEN, CLOSE = "<tool_call>", "</tool_call>"
log = logging.getLogger(__name__)


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def chosen_tools(tools: list[dict], tool_choice: str | dict) -> list[dict]:
    """The tools a reply may call: all of them, or the one ``tool_choice`` names."""
    if isinstance(tool_choice, dict):
        return [t for t in tools if t["name"] == tool_choice["name"]]
    return list(tools)


def closed(schema: Any) -> Any:
    """``schema`` with every object that lists its properties closed to others unless it says
    otherwise (as OpenAI's strict mode requires): a forced call fills the declared fields, and a
    model cannot wander off into keys of its own."""
    if isinstance(schema, list):
        return [closed(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: closed(v) if k in ("properties", "items", "anyOf", "oneOf", "allOf", "prefixItems", "$defs",
                                 "definitions") else v for k, v in schema.items()}
    for key in ("properties", "$defs", "definitions"):
        if isinstance(schema.get(key), dict):
            out[key] = {name: closed(sub) for name, sub in schema[key].items()}
    if "properties" in schema and "additionalProperties" not in schema:
        out["additionalProperties"] = False
    return out


def call_schema(tools: list[dict]) -> dict:
    """JSON schema of one call ``{"name": ..., "arguments": ...}`` to any of ``tools`` (compact
    JSON: no free whitespace for the model to wander in; objects closed, :func:`closed`)."""
    variants = [{"type": "object",
                 "properties": {"name": {"const": t["name"]},
                                "arguments": closed(t.get("parameters") or {"type": "object", "properties": {}})},
                 "required": ["name", "arguments"], "additionalProperties": False} for t in tools]
    schema = variants[0] if len(variants) == 1 else {"anyOf": variants}
    return {**schema, "x-guidance": {"whitespace_flexible": False}}


def forced_call_grammar(tools: list[dict]) -> str:
    """A Lark grammar (llguidance's dialect) of exactly one tagged call to one of ``tools``."""
    return f'start: "{OPEN}\\n" call "\\n{CLOSE}"\ncall: %json {json.dumps(call_schema(tools))}'


class ToolCallParser:
    """Text deltas in; text deltas and ToolCalls out, in order. Text inside a call is never passed on."""

    def __init__(self):
        self._buf = ""
        self._in_call = False

    def push(self, delta: str) -> list[str | ToolCall]:
        self._buf += delta
        out: list[str | ToolCall] = []
        while True:
            if self._in_call:
                end = self._buf.find(CLOSE)
                if end < 0:
                    return out
                call = _parse_call(self._buf[:end])
                if call is not None:
                    out.append(call)
                self._buf, self._in_call = self._buf[end + len(CLOSE):], False
                continue
            start = self._buf.find(OPEN)
            if start >= 0:
                if start:
                    out.append(self._buf[:start])
                self._buf, self._in_call = self._buf[start + len(OPEN):], True
                continue
            keep = _partial_tag(self._buf)  # a tag may be starting at the end: hold it back
            text, self._buf = self._buf[: len(self._buf) - keep], self._buf[len(self._buf) - keep:]
            if text:
                out.append(text)
            return out

    def flush(self) -> list[str | ToolCall]:
        """The end of the stream: held-back text goes out; an unclosed call is parsed if it can be."""
        buf, self._buf = self._buf, ""
        if self._in_call:
            self._in_call = False
            call = _parse_call(buf)  # cut off by the token limit: runs only if it is whole
            return [call] if call is not None else []
        return [buf] if buf else []


def _partial_tag(text: str) -> int:
    """Length of the longest end of ``text`` that begins ``<tool_call>``."""
    for n in range(min(len(OPEN) - 1, len(text)), 0, -1):
        if OPEN.startswith(text[-n:]):
            return n
    return 0


def _parse_call(body: str) -> ToolCall | None:
    """The call in a tag's body; None (logged) for one that is not a JSON object with a name: an
    unconstrained model's malformed call is not run."""
    try:
        call = json.loads(body)
    except json.JSONDecodeError:
        call = None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        log.warning("dropped a malformed tool call: %r", body[:200])
        return None
    arguments = call.get("arguments", {})
    return ToolCall(new_call_id(), call["name"], arguments if isinstance(arguments, str) else json.dumps(arguments))


def template_messages(messages: list[dict]) -> list[dict]:
    """OpenAI-format messages as chat templates take them: a call's ``arguments`` as a mapping."""
    out = []
    for m in messages:
        if m.get("tool_calls"):
            calls = [{"type": "function", "id": c.get("id"),
                      "function": {"name": c["function"]["name"], "arguments": _mapping(c["function"]["arguments"])}}
                     for c in m["tool_calls"]]
            m = {**m, "content": m.get("content") or "", "tool_calls": calls}
        out.append(m)
    return out


def _mapping(arguments: Any) -> Any:
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except json.JSONDecodeError:
            return arguments
    return arguments


def template_tools(tools: list[dict] | None) -> list[dict] | None:
    """Realtime-style function tools (flat) as chat templates take them (chat-completions style)."""
    if not tools:
        return None
    return [{"type": "function", "function": {k: t[k] for k in ("name", "description", "parameters") if k in t}}
            for t in tools]
