"""Who the agent is, per session: its instructions, voice, sampling, output and tools.

:class:`AgentSettings` is what a client sets (``session.update`` on either protocol) and may
override for one response; :meth:`AgentSettings.updated` validates a change as a whole, so a bad
value leaves the settings as they were (the session answers with one error and goes on).
Everything left unset keeps the server's configuration: the LLM replica's system prompt and
sampling, the TTS replica's default voice.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any, Collection

import jsonschema

from pipeline.conversation.voice_offer import LanguageRefused, VoiceOffer
from pipeline.engines import Sampling, Segment, Voice

MAX_INSTRUCTIONS_CHARS = 16_000
MAX_OUTPUT_TOKENS = 4096
MAX_VOICE_CLIP_S = 10.0  # a session's own reference clip
MAX_VOICE_CLIP_TEXT = 1_000
MAX_TOOLS = 64
MAX_TOOLS_CHARS = 32_000  # the tools as JSON, together: they are templated into every prompt
MAX_SCHEMA_DEPTH = 10  # nesting of a tool's parameters (objects and arrays within each other)
MODALITIES = (("audio",), ("text",))  # a reply always has text; "audio" adds its speech
TOOL_CHOICES = ("auto", "none", "required")
DEFAULT_VOICE = "default"
MAX_LANGUAGE_CHARS = 35  # a BCP 47 tag's practical length


class BadSetting(ValueError):
    """A session setting the server cannot take; ``param`` names it (as the client wrote it)."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param
        self.message = message


@dataclass(frozen=True)
class AgentSettings:
    instructions: str | None = None  # the system prompt; None: the LLM replica's configured one
    voice: str = DEFAULT_VOICE  # a voice configured on the TTS replica (its names: the gateway's voices)
    voice_reference: Segment | None = None  # the session's own reference clip, encoded (replaces the voice's)
    temperature: float | None = None  # None: the LLM replica's
    max_output_tokens: int | None = None  # None: the LLM replica's max_output_tokens
    modalities: tuple[str, ...] = ("audio",)
    tools: tuple[dict, ...] = ()  # OpenAI function tools, as the client sent them
    tool_choice: str | dict = "auto"
    tool_filler: str | None = None  # said while a tool call's result is awaited (e.g. "One moment.")
    tool_filler_after_ms: float = 700.0  # ... once it has been awaited this long
    language: str | None = None  # what the recogniser listens for and the voice speaks; None: the server's default

    @property
    def speaks(self) -> bool:
        return "audio" in self.modalities

    def sampling(self) -> Sampling:
        """How the LLM samples this session's replies (tools only where a call may be made)."""
        calls = bool(self.tools) and self.tool_choice != "none"
        return Sampling(temperature=self.temperature, max_output_tokens=self.max_output_tokens,
                        tools=self.tools if calls else None,
                        tool_choice=self.tool_choice if calls and self.tool_choice != "auto" else None)


    def tts_voice(self) -> Voice | None:
        """The ``voice`` argument of a TTS call; None for the server's default voice."""
        if self.voice == DEFAULT_VOICE and self.voice_reference is None:
            return None
        return Voice(self.voice, self.voice_reference)

    def messages(self, history: list[dict]) -> list[dict]:
        """The LLM's messages: the instructions (if set) as the system message, then the history. A
        session's language is told to the LLM there too (the user speaks it and the voice speaks
        the reply in it)."""
        system = [self.instructions] if self.instructions else []
        if self.language:
            system.append(f"The user speaks the language {self.language!r} (a BCP 47 code); reply in it.")
        return ([{"role": "system", "content": "\n\n".join(system)}] if system else []) + history

    def updated(self, changes: dict[str, Any], voices: Collection[str],
                offer: VoiceOffer = VoiceOffer()) -> "AgentSettings":
        """These settings with ``changes`` (field name -> value) applied, every value checked
        first (a language against what ``offer`` hears and the voice speaks); raises
        :class:`BadSetting` naming the first bad one, and changes nothing then."""
        unknown = set(changes) - {f.name for f in dataclasses.fields(self)}
        if unknown:
            name = sorted(unknown)[0]
            raise BadSetting(name, f"unknown setting {name!r}")
        checked = {name: _CHECKS[name](name, value, voices) for name, value in changes.items()}
        if "voice" in checked and checked["voice"] != self.voice and "voice_reference" not in checked:
            checked["voice_reference"] = None  # a session's clip belongs to the voice it was sent for
        agent = dataclasses.replace(self, **checked)
        if isinstance(agent.tool_choice, dict) and agent.tool_choice["name"] not in {t["name"] for t in agent.tools}:
            raise BadSetting("tool_choice", f"tool_choice names {agent.tool_choice['name']!r}, which is not one of "
                                            f"the tools {[t['name'] for t in agent.tools]}")
        if agent.tool_choice == "required" and not agent.tools:
            raise BadSetting("tool_choice", "tool_choice \"required\" needs tools")
        if "language" in checked or "voice" in checked:
            try:
                offer.check(agent.language, agent.voice)
            except LanguageRefused as exc:  # named by what this change moved: the language, else the voice
                moved = agent.language != self.language or agent.voice == self.voice
                raise BadSetting("language" if moved else "voice", str(exc)) from None
        return agent

    def describe(self) -> dict[str, Any]:
        """The settings as a client reads them back (``session.updated``)."""
        return {"instructions": self.instructions, "voice": self.voice,
                "voice_clip": None if self.voice_reference is None else {"text": self.voice_reference.text,
                                                                        "frames": len(self.voice_reference.codes)},
                "temperature": self.temperature, "max_output_tokens": self.max_output_tokens,
                "output_modalities": list(self.modalities), "tools": list(self.tools),
                "tool_choice": self.tool_choice, "tool_filler": self.tool_filler,
                "tool_filler_after_ms": self.tool_filler_after_ms, "language": self.language}


def _instructions(name: str, value: Any, _voices) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str):
        raise BadSetting(name, f"{name} must be a string, got {type(value).__name__}")
    if len(value) > MAX_INSTRUCTIONS_CHARS:
        raise BadSetting(name, f"{name} of {len(value)} characters exceeds {MAX_INSTRUCTIONS_CHARS}")
    return value or None


def _voice(name: str, value: Any, voices: Collection[str]) -> str:
    if not isinstance(value, str):
        raise BadSetting(name, f"{name} must be a string, got {type(value).__name__}")
    if value not in voices:
        raise BadSetting(name, f"unknown voice {value!r}; this server has {sorted(voices)}")
    return value


def _language(name: str, value: Any, _voices) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or not 0 < len(value) <= MAX_LANGUAGE_CHARS:
        raise BadSetting(name, f"{name} must be a language code such as 'en' or 'fr', or null; got {value!r}")
    return value


def _reference(name: str, value: Any, _voices) -> Segment | None:
    if value is not None and not isinstance(value, Segment):
        raise BadSetting(name, f"{name} must be an encoded clip")
    return value


def _temperature(name: str, value: Any, _voices) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 2:
        raise BadSetting(name, f"{name} must be a number from 0 to 2, got {value!r}")
    return float(value)


def _max_output_tokens(name: str, value: Any, _voices) -> int | None:
    if value is None or value == "inf":
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_OUTPUT_TOKENS:
        raise BadSetting(name, f"{name} must be an integer from 1 to {MAX_OUTPUT_TOKENS} or \"inf\", got {value!r}")
    return value


def _modalities(name: str, value: Any, _voices) -> tuple[str, ...]:
    if not isinstance(value, (list, tuple)) or tuple(value) not in MODALITIES:
        raise BadSetting(name, f"{name} must be [\"audio\"] or [\"text\"], got {value!r}")
    return tuple(value)


def depth(value: Any) -> int:
    """How deeply lists and dicts nest in ``value`` (a scalar: 0), without recursion."""
    deepest, todo = 0, [(value, 1)]
    while todo:
        node, level = todo.pop()
        children = node.values() if isinstance(node, dict) else node if isinstance(node, (list, tuple)) else None
        if children is not None:
            deepest = max(deepest, level)
            todo.extend((child, level + 1) for child in children)
    return deepest


def check_tools_depth(name: str, tools: Any) -> None:
    """Raises BadSetting where a tool's parameters nest deeper than MAX_SCHEMA_DEPTH."""
    levels = depth(tools)
    if levels > MAX_SCHEMA_DEPTH + 3:  # the list, a tool, its parameters: then the schema's own nesting
        raise BadSetting(name, f"{name}: a tool's parameters nest {levels - 3} levels deep; at most {MAX_SCHEMA_DEPTH}")


def _tools(name: str, value: Any, _voices) -> tuple[dict, ...]:
    if value is None:
        return ()
    if not isinstance(value, (list, tuple)) or len(value) > MAX_TOOLS:
        raise BadSetting(name, f"{name} must be a list of at most {MAX_TOOLS} function tools")
    check_tools_depth(name, value)
    size = len(json.dumps(value))
    if size > MAX_TOOLS_CHARS:
        raise BadSetting(name, f"{name} are {size} characters of JSON together; at most {MAX_TOOLS_CHARS}")
    for i, tool in enumerate(value):
        if not isinstance(tool, dict) or tool.get("type", "function") != "function":
            raise BadSetting(f"{name}[{i}]", f"{name}[{i}] must be a function tool ({{\"type\": \"function\", ...}})")
        if not isinstance(tool.get("name"), str) or not tool["name"]:
            raise BadSetting(f"{name}[{i}].name", f"{name}[{i}] needs a name")
        schema = tool.get("parameters", {"type": "object"})
        if not isinstance(schema, dict):
            raise BadSetting(f"{name}[{i}].parameters", f"{name}[{i}].parameters must be a JSON schema object")
        try:
            jsonschema.validators.validator_for(schema).check_schema(schema)
        except jsonschema.SchemaError as exc:
            raise BadSetting(f"{name}[{i}].parameters",
                             f"{name}[{i}].parameters is not a valid JSON schema: {exc.message}") from None
    names = [t["name"] for t in value]
    if len(set(names)) != len(names):
        raise BadSetting(name, f"{name}: two tools have the same name")
    return tuple(dict(t, type="function") for t in value)


def _tool_choice(name: str, value: Any, _voices) -> str | dict:
    if isinstance(value, str) and value in TOOL_CHOICES:
        return value
    if isinstance(value, dict) and value.get("type") == "function" and isinstance(value.get("name"), str):
        return {"type": "function", "name": value["name"]}
    raise BadSetting(name, f"{name} must be one of {TOOL_CHOICES} or {{\"type\": \"function\", \"name\": ...}}, "
                           f"got {value!r}")


def _filler(name: str, value: Any, _voices) -> str | None:
    if value is None or value == "":
        return None
    if not isinstance(value, str) or len(value) > 200:
        raise BadSetting(name, f"{name} must be a short text (at most 200 characters) or null")
    return value


def _filler_after(name: str, value: Any, _voices) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 60_000:
        raise BadSetting(name, f"{name} must be a number of milliseconds from 0 to 60000, got {value!r}")
    return float(value)


_CHECKS = {"instructions": _instructions, "voice": _voice, "voice_reference": _reference,
           "temperature": _temperature, "max_output_tokens": _max_output_tokens, "modalities": _modalities,
           "tools": _tools, "tool_choice": _tool_choice, "tool_filler": _filler, "tool_filler_after_ms": _filler_after,
           "language": _language}
