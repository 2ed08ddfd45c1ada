"""An LLM backend over any OpenAI-compatible server (vLLM, llama.cpp, TGI, OpenAI, ...).

``POST {openai_url}/chat/completions`` with ``"stream": true``; the reply is Server-Sent
Events, one ``data: {json}`` line per chunk, ending with ``data: [DONE]``.

The engine is asynchronous (``astream``, on ``httpx.AsyncClient``) and runs on the replica's
event loop, not on its inference thread: waiting on the network is not model work, and a
blocking read there would stall every other session's stream behind one slow upstream.
"""
from __future__ import annotations

import asyncio
import json
import urllib.parse
from typing import Any, AsyncIterator

import httpx

from pipeline.engines import LLMFinish, Sampling, ToolCall
from pipeline.llm.config import LLMConfig
from pipeline.llm.engine import Message, build_prompt
from pipeline.llm.tool_calls import new_call_id, template_tools

_DONE = "[DONE]"


class OpenAIStreamError(RuntimeError):
    """The server refused the request or sent an error event."""


class OpenAIEngine:
    """The LLM interface with ``astream`` (async) instead of ``stream``: generation by an HTTP server."""

    def __init__(self, cfg: LLMConfig):
        self.cfg = cfg
        base = cfg.openai_url.rstrip("/")
        url = urllib.parse.urlsplit(base)
        if url.scheme not in ("http", "https") or not url.hostname:
            raise ValueError(f"openai_url must be an http(s) URL, got {cfg.openai_url!r}")
        self._host = url.hostname
        self._url = base + "/chat/completions"
        self._active = 0
        self._client: httpx.AsyncClient | None = None
        self._client_loop: asyncio.AbstractEventLoop | None = None

    @property
    def active_requests(self) -> int:
        """Streams whose HTTP request is open (started, neither finished nor closed)."""
        return self._active

    def warmup(self) -> None:
        """Nothing to load; the server warms itself."""

    async def astream(self, messages: list[Message], sampling: Sampling = Sampling()
                      ) -> AsyncIterator[str | ToolCall | LLMFinish]:
        """Text deltas of the reply to ``messages``, sampled as ``sampling`` (:meth:`request_body`).

        Closing or cancelling the generator closes the HTTP response (the server sees the
        connection drop and stops generating)."""
        body = self.request_body(messages, sampling)
        reason, usage = None, None
        calls: dict[int, dict] = {}  # tool calls by index, assembled from their deltas
        self._active += 1  # only the event loop's thread touches the count
        try:
            async with self._http().stream("POST", self._url, json=body, headers=self._headers()) as resp:
                await _raise_for_status(resp)
                resp.encoding = "utf-8"  # SSE is UTF-8 whatever the Content-Type says
                async for data in _sse_data(resp.aiter_lines()):
                    if data == _DONE:
                        break
                    chunk = _chunk(data)
                    delta = _delta(chunk)
                    if delta:
                        yield delta
                    _add_call_deltas(calls, chunk)
                    reason = _finish_reason(chunk) or reason
                    usage = chunk.get("usage") or usage
        finally:
            self._active -= 1
        for index in sorted(calls):
            call = calls[index]
            yield ToolCall(call["id"] or new_call_id(), call["name"], call["arguments"] or "{}")
        if reason == "length" or usage:  # something to tell beyond a natural end
            usage = usage or {}
            yield LLMFinish(reason or "stop", usage.get("prompt_tokens"), usage.get("completion_tokens"))

    def request_body(
        self,
        messages: list[Message],
        sampling: Sampling = Sampling(),
        *,
        top_k: int | None = None,
        top_p: float | None = None,
        seed: int | None = None,
    ) -> dict[str, Any]:
        """The chat-completions request: trimmed prompt, config sampling unless ``sampling`` or the
        keyword arguments override it, and the session's tools (OpenAI's chat-completions shape)
        passed upstream. ``max_output_tokens`` goes as the API's own ``max_tokens``."""
        cfg, tools, tool_choice = self.cfg, sampling.tools, sampling.tool_choice
        max_output, temperature = sampling.max_output_tokens, sampling.temperature
        msgs = build_prompt(messages, cfg.system_prompt, cfg.history_tokens)
        body: dict[str, Any] = {
            "model": cfg.openai_model,
            "messages": [_message(m) for m in msgs],
            "stream": True,
            "max_tokens": cfg.max_output_tokens if max_output is None else int(max_output),
            "temperature": cfg.temperature if temperature is None else float(temperature),
        }
        p = cfg.top_p if top_p is None else float(top_p)
        if p < 1.0:
            body["top_p"] = p
        k = cfg.top_k if top_k is None else int(top_k)
        if k > 0 and not self._host.endswith("openai.com"):
            body["top_k"] = k  # an extension that vLLM / llama.cpp / TGI accept; OpenAI's API does not
        if seed is not None:
            body["seed"] = int(seed)
        if tools:
            body["tools"] = template_tools(tools)
            if tool_choice is not None:
                body["tool_choice"] = ({"type": "function", "function": {"name": tool_choice["name"]}}
                                       if isinstance(tool_choice, dict) else tool_choice)
        return body

    # -- internals ----------------------------------------------------------------------------

    def _http(self) -> httpx.AsyncClient:
        """The client of the running event loop: pooled connections belong to the loop that
        opened them, so a new loop (a test's ``asyncio.run``) gets a new client."""
        loop = asyncio.get_running_loop()
        if self._client is None or self._client_loop is not loop:
            self._client = httpx.AsyncClient(timeout=self.cfg.openai_timeout_s)
            self._client_loop = loop
        return self._client

    def _headers(self) -> dict[str, str]:
        h = {"Accept": "text/event-stream"}
        if self.cfg.openai_api_key:
            h["Authorization"] = f"Bearer {self.cfg.openai_api_key}"
        return h


async def _raise_for_status(resp: httpx.Response) -> None:
    if resp.status_code != 200:
        detail = (await resp.aread())[:2000].decode("utf-8", "replace")
        raise OpenAIStreamError(f"POST {resp.request.url.path} -> HTTP {resp.status_code}: {detail}")


async def _sse_data(lines: AsyncIterator[str]) -> AsyncIterator[str]:
    """The payload of each event's ``data:`` lines (multi-line events joined with newlines).

    A blank line ends an event; comments (``:``, keep-alives) and other fields (``event:``,
    ``id:``, ``retry:``) are skipped; ``[DONE]`` is passed on at once; an unterminated last
    event is passed on at EOF."""
    data: list[str] = []
    async for line in lines:
        if not line:
            if data:
                yield "\n".join(data)
                data = []
        elif line.startswith("data:"):
            payload = line[5:]
            data.append(payload[1:] if payload.startswith(" ") else payload)
            if data[-1] == _DONE:
                yield _DONE
                return
    if data:
        yield "\n".join(data)


def _chunk(data: str) -> dict:
    """One SSE payload as a chunk; raises :class:`OpenAIStreamError` on an error event or bad JSON."""
    try:
        chunk = json.loads(data)
    except json.JSONDecodeError as exc:
        raise OpenAIStreamError(f"bad SSE payload: {data[:200]!r}") from exc
    if not isinstance(chunk, dict):
        raise OpenAIStreamError(f"bad SSE payload: {data[:200]!r}")
    if "error" in chunk:
        raise OpenAIStreamError(f"server error: {chunk['error']}")
    return chunk


def _delta(chunk: dict) -> str:
    """The text of one chunk."""
    choices = chunk.get("choices") or []
    if not choices:
        return ""
    choice = choices[0]
    return (choice.get("delta") or {}).get("content") or choice.get("text") or ""


def _message(m: Message) -> dict[str, Any]:
    """A conversation message as chat completions take it (tool calls and results included)."""
    out: dict[str, Any] = {"role": m["role"], "content": m.get("content") or ""}
    if m.get("tool_calls"):
        out["tool_calls"] = m["tool_calls"]
    if m.get("tool_call_id"):
        out["tool_call_id"] = m["tool_call_id"]
    return out


def _add_call_deltas(calls: dict[int, dict], chunk: dict) -> None:
    """Fold a chunk's ``delta.tool_calls`` into the calls being assembled (OpenAI streams a call's id
    and name once, then its arguments in pieces)."""
    for choice in chunk.get("choices") or []:
        for piece in (choice.get("delta") or {}).get("tool_calls") or []:
            call = calls.setdefault(int(piece.get("index", 0)), {"id": None, "name": "", "arguments": ""})
            call["id"] = piece.get("id") or call["id"]
            function = piece.get("function") or {}
            call["name"] += function.get("name") or ""
            call["arguments"] += function.get("arguments") or ""


def _finish_reason(chunk: dict) -> str | None:
    choices = chunk.get("choices") or []
    return choices[0].get("finish_reason") if choices else None
