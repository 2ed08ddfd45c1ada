"""An LLM backend over any OpenAI-compatible server (vLLM, llama.cpp, TGI, OpenAI, ...).

``POST {openai_url}/chat/completions`` with ``"stream": true``; the reply is Server-Sent
Events, one ``data: {json}`` line per chunk, ending with ``data: [DONE]``. Only the standard
library (``http.client``) is used, so the connection can be closed from ``close()`` at once.
"""
from __future__ import annotations

import http.client
import json
import logging
import ssl
import threading
import time
import urllib.parse
from typing import Any, Iterator

from pipeline.llm.config import LLMConfig
from pipeline.llm.engine import Message, build_prompt

log = logging.getLogger(__name__)


class OpenAIStreamError(RuntimeError):
    """The server refused the request or sent an error event."""


class OpenAIEngine:
    """Same interface as :class:`pipeline.llm.engine.LLMEngine`, generation done by an HTTP server."""

    def __init__(self, cfg: LLMConfig):
        self.cfg = cfg
        url = urllib.parse.urlsplit(cfg.openai_url.rstrip("/"))
        if url.scheme not in ("http", "https") or not url.hostname:
            raise ValueError(f"openai_url must be an http(s) URL, got {cfg.openai_url!r}")
        self._scheme = url.scheme
        self._host = url.hostname
        self._port = url.port or (443 if url.scheme == "https" else 80)
        self._path = (url.path or "") + "/chat/completions"
        self._active = 0
        self._lock = threading.Lock()

    @property
    def active_requests(self) -> int:
        return self._active

    def warmup(self) -> None:
        """Nothing to load; the server warms itself."""

    def stream(
        self,
        messages: list[Message],
        *,
        max_new_tokens: int | None = None,
        temperature: float | None = None,
        top_k: int | None = None,
        top_p: float | None = None,
        seed: int | None = None,
    ) -> "OpenAIStream":
        cfg = self.cfg
        msgs = build_prompt(messages, cfg.system_prompt, cfg.history_tokens)
        body: dict[str, Any] = {
            "model": cfg.openai_model,
            "messages": [{"role": m["role"], "content": m.get("content") or ""} for m in msgs],
            "stream": True,
            "max_tokens": cfg.max_new_tokens if max_new_tokens is None else int(max_new_tokens),
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
        return OpenAIStream(self, body)

    # -- internals ----------------------------------------------------------------------------

    def _connect(self) -> http.client.HTTPConnection:
        timeout = self.cfg.openai_timeout_s
        if self._scheme == "https":
            return http.client.HTTPSConnection(
                self._host, self._port, timeout=timeout, context=ssl.create_default_context()
            )
        return http.client.HTTPConnection(self._host, self._port, timeout=timeout)

    def _headers(self) -> dict[str, str]:
        h = {"Content-Type": "application/json", "Accept": "text/event-stream"}
        if self.cfg.openai_api_key:
            h["Authorization"] = f"Bearer {self.cfg.openai_api_key}"
        return h

    def _opened(self) -> None:
        with self._lock:
            self._active += 1

    def _closed(self) -> None:
        with self._lock:
            self._active -= 1


class OpenAIStream(Iterator[str]):
    """Text deltas of one streamed chat completion; ``close()`` drops the connection."""

    def __init__(self, engine: OpenAIEngine, body: dict[str, Any]):
        self.engine = engine
        self.body = body
        self.finish_reason: str | None = None
        self.text = ""
        self.first_token_s: float | None = None
        self._conn: http.client.HTTPConnection | None = None
        self._resp: http.client.HTTPResponse | None = None
        self._done = False
        self._started = False
        self._state_lock = threading.Lock()
        engine._opened()

    def __iter__(self) -> "OpenAIStream":
        return self

    def __next__(self) -> str:
        if self._done:
            raise StopIteration
        try:
            if not self._started:
                self._start()
            while True:
                data = self._read_event()
                if self._done:
                    raise StopIteration
                if data is None or data == "[DONE]":
                    self._finish(self.finish_reason or "stop")
                    raise StopIteration
                delta = self._parse(data)
                if delta:
                    self.text += delta
                    return delta
        except StopIteration:
            raise
        except Exception:
            if self._done:  # closed from elsewhere while reading: a normal cancellation
                raise StopIteration from None
            self._finish("error")
            raise

    def close(self) -> None:
        """Cancel: close the HTTP connection (also unblocks a read on another thread)."""
        self._finish("cancelled")

    def __enter__(self) -> "OpenAIStream":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        try:
            self._finish("cancelled")
        except Exception:  # noqa: BLE001
            pass

    # -- internals ----------------------------------------------------------------------------

    def _start(self) -> None:
        self._started = True
        eng = self.engine
        t0 = time.perf_counter()
        conn = eng._connect()
        with self._state_lock:
            if self._done:
                conn.close()
                raise StopIteration
            self._conn = conn
        conn.request("POST", eng._path, body=json.dumps(self.body).encode(), headers=eng._headers())
        resp = conn.getresponse()
        self._resp = resp
        self._t0 = t0
        if resp.status != 200:
            detail = resp.read(2000).decode("utf-8", "replace")
            raise OpenAIStreamError(f"POST {eng._path} -> HTTP {resp.status}: {detail}")

    def _read_event(self) -> str | None:
        """The payload of the next ``data:`` line (multi-line events joined); None at EOF."""
        resp = self._resp
        lines: list[str] = []
        while True:
            if resp is None or self._done:
                return None
            raw = resp.readline()
            if not raw:
                return "\n".join(lines) if lines else None
            line = raw.decode("utf-8").rstrip("\r\n")
            if not line:  # blank line ends an event
                if lines:
                    return "\n".join(lines)
                continue
            if line.startswith(":"):  # comment / keep-alive
                continue
            if line.startswith("data:"):
                payload = line[5:]
                lines.append(payload[1:] if payload.startswith(" ") else payload)
                if lines[-1] == "[DONE]":
                    return "[DONE]"
            # other fields (event:, id:, retry:) are ignored

    def _parse(self, data: str) -> str:
        try:
            chunk = json.loads(data)
        except json.JSONDecodeError as exc:
            raise OpenAIStreamError(f"bad SSE payload: {data[:200]!r}") from exc
        if "error" in chunk:
            raise OpenAIStreamError(f"server error: {chunk['error']}")
        choices = chunk.get("choices") or []
        if not choices:
            return ""
        choice = choices[0]
        if choice.get("finish_reason"):
            self.finish_reason = choice["finish_reason"]
        delta = (choice.get("delta") or {}).get("content") or choice.get("text") or ""
        if delta and self.first_token_s is None:
            self.first_token_s = time.perf_counter() - self._t0
        return delta

    def _finish(self, reason: str) -> None:
        with self._state_lock:
            if self._done:
                return
            self._done = True
            conn, resp = self._conn, self._resp
            self._conn = self._resp = None
            self.engine._closed()
        if self.finish_reason is None or reason in ("cancelled", "error"):
            self.finish_reason = reason
        if resp is not None:
            try:
                # Shut the socket first so a blocked readline on another thread returns now.
                sock = getattr(getattr(resp, "fp", None), "raw", None)
                sock = getattr(sock, "_sock", None)
                if sock is not None:
                    import socket

                    sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            try:
                resp.close()
            except Exception:  # noqa: BLE001
                pass
        if conn is not None:
            try:
                conn.close()
            except Exception:  # noqa: BLE001
                pass
