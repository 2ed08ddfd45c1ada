"""Gateway deployment: the WebSocket ingress. Holds the sessions; models live elsewhere."""
# No `from __future__ import annotations` here: FastAPI must see the real WebSocket type
# through Ray Serve's class-based view, or the WebSocket route rejects every handshake (403).
import asyncio
from typing import AsyncIterator

import numpy as np
from fastapi import FastAPI, WebSocket
from fastapi.responses import JSONResponse, Response
from ray import serve
from ray.serve.handle import DeploymentHandle
from starlette.websockets import WebSocketDisconnect

from pipeline import metrics
from pipeline import protocol as P
from pipeline.connection import ClientGone, SessionRegistry, serve_connection
from pipeline.session import NoFreeSlot, SessionConfig

api = FastAPI(title="gapless", docs_url=None, redoc_url=None)


async def _remote_stream(gen) -> AsyncIterator:
    """Iterate a streaming handle call; cancel the remote generator if we stop early."""
    try:
        async for item in gen:
            yield item
    finally:
        gen.cancel()


class WebSocketConnection:
    """A Starlette WebSocket as the :class:`pipeline.connection.Connection` a session is served over."""

    def __init__(self, ws: WebSocket):
        self.ws = ws

    async def receive(self):
        try:
            msg = await self.ws.receive()
        except WebSocketDisconnect:
            return None
        if msg["type"] == "websocket.disconnect":
            return None
        frame = msg.get("bytes")
        return frame if frame is not None else msg.get("text", "")

    async def send(self, frame: bytes) -> None:
        try:
            await self.ws.send_bytes(frame)
        except WebSocketDisconnect:
            raise ClientGone() from None

    async def close(self, code: int, reason: str) -> None:
        await self.ws.close(code=code, reason=reason)


class RayBackends:
    """The session's view of the engines, through deployment handles."""

    def __init__(self, stt: DeploymentHandle, llm: DeploymentHandle, tts: DeploymentHandle):
        self.stt, self.llm, self.tts = stt, llm, tts

    async def stt_open(self, sid: str) -> None:
        reason = await self.stt.open.remote(sid)
        if reason:
            raise NoFreeSlot(reason)

    async def stt_push(self, sid: str, pcm: np.ndarray) -> list[dict]:
        return await self.stt.push.remote(sid, pcm)

    async def stt_finish(self, sid: str) -> tuple[str, list[dict]]:
        return await self.stt.finish.remote(sid)

    async def stt_close(self, sid: str) -> None:
        await self.stt.close.remote(sid)

    def llm_stream(self, messages: list[dict]) -> AsyncIterator[str]:
        return _remote_stream(self.llm.options(stream=True).stream.remote(messages))

    def tts_stream(self, text: str, context: list) -> AsyncIterator[tuple[np.ndarray, np.ndarray]]:
        return _remote_stream(self.tts.options(stream=True).stream.remote(text, context))

    async def tts_encode(self, pcm: np.ndarray) -> np.ndarray:
        return await self.tts.encode.remote(pcm)


@serve.deployment(ray_actor_options={"num_cpus": 0.25}, max_ongoing_requests=1000)
@serve.ingress(api)
class Gateway:
    def __init__(self, stt: DeploymentHandle, llm: DeploymentHandle, tts: DeploymentHandle, session: dict):
        self.backends = RayBackends(stt, llm, tts)
        self.handles = {"stt": stt, "llm": llm, "tts": tts}
        self.session_cfg = self._session_config(dict(session))
        for code in (P.E_INTERNAL, P.E_NO_FREE_SLOT, P.E_SERVER_BUSY, P.E_IDLE_TIMEOUT, P.E_TURN_TOO_LONG):
            metrics.ERRORS.labels(code=code).inc(0)
        # This replica's sessions, at most session.max_sessions; the gauge follows its count.
        self.sessions = SessionRegistry(self.session_cfg.max_sessions, on_count=metrics.SESSIONS_ACTIVE.set)

    @api.get("/healthz")
    async def healthz(self):
        """200 once every model deployment has loaded and warmed up, 503 before."""
        names = list(self.handles)
        calls = [asyncio.wait_for(self.handles[n].ready.remote(), timeout=2.0) for n in names]
        results = await asyncio.gather(*calls, return_exceptions=True)
        status = {n: (r is True) for n, r in zip(names, results)}
        ok = all(status.values())
        return JSONResponse({"ok": ok, "deployments": status}, status_code=200 if ok else 503)

    @api.get("/metrics")
    async def metrics(self):
        """Prometheus scrape target: every deployment process of this node."""
        return Response(metrics.exposition(), media_type=metrics.CONTENT_TYPE_LATEST)

    @staticmethod
    def _session_config(session_args: dict) -> SessionConfig:
        return SessionConfig(
            **session_args,
            on_chunk_gap=metrics.AUDIO_CHUNK_GAP.observe,
            on_first_audio=metrics.TIME_TO_FIRST_AUDIO.observe,
            on_turn=metrics.TURNS.inc,
            on_interrupt=metrics.BARGE_INS.inc,
            on_error=lambda code: metrics.ERRORS.labels(code=code).inc(),
        )

    @api.websocket("/v1/conversation")
    async def conversation(self, ws: WebSocket) -> None:
        """Admission, the receive loop, limits and clean-up live in pipeline.connection (no Ray)."""
        await ws.accept()
        await serve_connection(WebSocketConnection(ws), self.backends, self.session_cfg, self.sessions)
