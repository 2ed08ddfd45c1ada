"""Gateway deployment: the WebSocket ingress. Holds the sessions; models live elsewhere."""
# No `from __future__ import annotations` here: FastAPI must see the real WebSocket type
# through Ray Serve's class-based view, or the WebSocket route rejects every handshake (403).
import asyncio
import functools
import json
import logging
import os
import time
from collections import Counter
from pathlib import Path
from typing import AsyncIterator
from urllib.parse import parse_qsl

import numpy as np
import ray
from fastapi import FastAPI, Request, WebSocket
from fastapi.responses import FileResponse, JSONResponse, PlainTextResponse, Response
from fastapi.staticfiles import StaticFiles
from ray import exceptions as ray_errors
from ray import serve
from ray.serve import exceptions as serve_errors
from ray.serve._private.common import ReplicaState
from ray.serve._private.constants import SERVE_CONTROLLER_NAME, SERVE_NAMESPACE
from ray.serve.handle import DeploymentHandle
from starlette.exceptions import HTTPException
from starlette.websockets import WebSocketDisconnect

from deployments import proxy_limits
from deployments.session_store import RaySnapshots
from pipeline import metrics
from pipeline.adapters.phone.adapter import serve_call
from pipeline.adapters.realtime.adapter import RealtimeSession
from pipeline.adapters.v1.adapter import Session
from pipeline.adapters.webrtc.adapter import WebRTCSession
from pipeline.adapters.v1 import protocol as P
from pipeline.door.admission import Gatekeeper, Handshake, Refused
from pipeline.door.auth import TICKET_PARAM, AuthConfig, AuthError, Authenticator, bearer, load_tokens
from pipeline.door.client_limits import ClientLimits
from pipeline.adapters.v1.options import refuse_options, session_options
from pipeline.connection import ClientGone, Resumption, SessionRegistry, serve_connection
from pipeline.resume.keeper import Continuity
from pipeline.adapters.phone.config import carrier_secrets, carriers_calls, read_phone_section
from pipeline.adapters.phone.carriers import DIALECTS
from pipeline.adapters.phone.twilio_webhook import TwilioWebhook, WebhookRefused, signed_url, stream_url
from pipeline.adapters.webrtc.peer import OfferRefused, Peer, read_webrtc_section
from pipeline.adapters.realtime.adapter import check_opening_session
from pipeline.adapters.realtime.adapter import refusal as realtime_refusal
from pipeline.conversation.agent import BadSetting
from pipeline.door.bodies import (BODY_TIMEOUT_S, MAX_BODIES_READING, MAX_FORM_BYTES, MAX_SDP_BYTES,
                                  MAX_SESSION_JSON_BYTES, MULTIPART_SLACK)
from pipeline.adapters.realtime.client_events import ClientEventError
from pipeline.conversation.ears.listening import warm_listening
from pipeline.audio_constants import USER_RATE
from pipeline.engines import (Backends, EngineUnavailable, LLMFinish, NoFreeSlot, Sampling, Segment, ToolCall,
                              Voice)
from pipeline.session_config import read_session_section

api = FastAPI(title="gapless", docs_url=None, redoc_url=None, openapi_url=None)
log = logging.getLogger(__name__)
# A stopping replica notices within DRAIN_POLL_S and gives its sessions DRAIN_TIMEOUT_S to leave;
# its deployment's graceful_shutdown_timeout_s (serve configs) must exceed both together.
DRAIN_POLL_S = 0.5
DRAIN_TIMEOUT_S = 10.0
HEALTH_TTL_S = 1.0  # /healthz asks the model replicas and Serve's controller at most this often
# The accepted WebSocket names the gateway replica serving it (which one holds a call, after a resume).
REPLICA_HEADER = b"x-gapless-replica"

# The browser client (web/): plain files, no build step. Its scripts come from this origin only.
WEB_DIR = Path(__file__).resolve().parents[1] / "web"
PAGE_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; connect-src 'self'; img-src 'self' data:; "
                               "media-src 'self' blob:; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
}
api.mount("/web", StaticFiles(directory=WEB_DIR), name="web")


@api.middleware("http")
async def _door(request: Request, call_next):
    """Every HTTP route: a ``Host`` that is not one of this server's names is refused (403
    host_not_allowed; WebSocket handshakes are checked in admission), and the web client's files
    carry the page's security headers."""
    gate = getattr(request.app.state, "gate", None)
    if gate is not None:
        try:
            gate.check_host(dict(request.headers))
        except Refused as refused:
            metrics.HANDSHAKES_REFUSED.labels(code=refused.code).inc()
            return _refusal_response(refused)
    response = await call_next(request)
    if request.url.path.startswith("/web/"):
        response.headers.update(PAGE_HEADERS)
    return response

# What Ray raises when the replica serving a call is gone or cannot be reached: the session
# tells its client engine_unavailable (and carries on), never internal.
REPLICA_GONE = (ray_errors.RayActorError, ray_errors.ActorUnavailableError, ray_errors.NodeDiedError,
                ray_errors.WorkerCrashedError, ray_errors.ObjectLostError, ray_errors.OwnerDiedError,
                serve_errors.DeploymentUnavailableError, serve_errors.BackPressureError)


def _engine_call(method):
    """A Backends method whose replica may die under it: Ray's errors become EngineUnavailable."""

    @functools.wraps(method)
    async def call(*args, **kwargs):
        try:
            return await method(*args, **kwargs)
        except REPLICA_GONE as exc:
            raise EngineUnavailable(f"{type(exc).__name__}: the replica is gone") from None

    return call


async def _remote_stream(gen) -> AsyncIterator:
    """Iterate a streaming handle call; cancel the remote generator if we stop early."""
    try:
        async for item in gen:
            yield item
    except REPLICA_GONE as exc:
        raise EngineUnavailable(f"{type(exc).__name__}: the replica is gone") from None
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

    async def send(self, frame: bytes | str) -> None:
        try:
            if isinstance(frame, str):
                await self.ws.send_text(frame)
            else:
                await self.ws.send_bytes(frame)
        except WebSocketDisconnect:
            raise ClientGone() from None

    async def close(self, code: int, reason: str) -> None:
        await self.ws.close(code=code, reason=reason)


def _app_status(app_name: str):
    """This application's status from Serve's controller (a blocking call: run it in a thread)."""
    return serve.status().applications.get(app_name)


class RayBackends(Backends):
    """The session's :class:`~pipeline.engines.Backends` through deployment handles (its in-process
    twin is ``pipeline.services.LocalBackends``). Every STT call of one stream carries its id as the
    routing key, so the STT deployment's consistent-hash router sends them all to the replica that
    holds the stream (UnknownStream comes back as itself)."""

    def __init__(self, stt: DeploymentHandle, llm: DeploymentHandle, tts: DeploymentHandle):
        self.stt, self.llm, self.tts = stt, llm, tts

    def _stt(self, sid: str) -> DeploymentHandle:
        return self.stt.options(session_id=sid)

    @_engine_call
    async def stt_open(self, sid: str) -> None:
        reason = await self._stt(sid).open.remote(sid)
        if reason:
            raise NoFreeSlot(reason)

    @_engine_call
    async def stt_push(self, sid: str, pcm: np.ndarray) -> list[dict]:
        return await self._stt(sid).push.remote(sid, pcm)

    @_engine_call
    async def stt_finish(self, sid: str) -> tuple[str, list[dict]]:
        return await self._stt(sid).finish.remote(sid)

    @_engine_call
    async def stt_peek(self, sid: str) -> tuple[str, list[dict]] | None:
        return await self._stt(sid).peek.remote(sid)

    @_engine_call
    async def stt_close(self, sid: str) -> None:
        await self._stt(sid).close.remote(sid)

    def llm_stream(self, messages: list[dict], sampling: Sampling) -> AsyncIterator[str | ToolCall | LLMFinish]:
        return _remote_stream(self.llm.options(stream=True).stream.remote(messages, sampling))

    def tts_stream(self, text: str, context: list[Segment], voice: Voice | None = None
                   ) -> AsyncIterator[tuple[np.ndarray, np.ndarray]]:
        return _remote_stream(self.tts.options(stream=True).stream.remote(text, context, voice))

    @_engine_call
    async def tts_encode(self, pcm: np.ndarray, rate: int = USER_RATE) -> np.ndarray:
        return await self.tts.encode.remote(pcm, rate)


def _refusal_response(refused: Refused) -> JSONResponse:
    headers = {"WWW-Authenticate": "Bearer"} if refused.status == 401 else {}
    return JSONResponse(refused.body(), status_code=refused.status, headers=headers)


async def _deny(ws: WebSocket, refused: Refused) -> None:
    """Answer a handshake with an HTTP error instead of the upgrade. Where the server does not
    offer ASGI's denial-response extension, closing before accepting makes it answer 403."""
    try:
        await ws.send_denial_response(_refusal_response(refused))
    except RuntimeError:
        await ws.close(code=P.CLOSE_POLICY_VIOLATION)


class BodyRefused(Exception):
    """A request body this server does not read: HTTP ``status``, with ``code`` and ``message``."""

    def __init__(self, status: int, code: str, message: str, param: str | None = None):
        super().__init__(message)
        self.status, self.code, self.message, self.param = status, code, message, param

    def response(self) -> JSONResponse:
        error = {"type": "invalid_request_error", "code": self.code, "message": self.message}
        if self.param is not None:
            error["param"] = self.param
        return JSONResponse({"error": error}, self.status, headers={"Retry-After": "1"} if self.status == 503 else None)


_reading = Counter()  # "bodies": the request bodies this replica is reading now


async def _body(request: Request, limit: int) -> bytes:
    """The request's body, declared or chunked, read no further than ``limit`` bytes and within
    BODY_TIMEOUT_S, at most MAX_BODIES_READING at once on this replica (pipeline/door/bodies.py).
    The proxy's body limits hold anonymous bodies to the same before this runs; a body with a
    credential streams on to here, and auth mode none checks no credential."""
    declared = request.headers.get("content-length") or ""
    if declared.isdigit() and int(declared) > limit:
        raise BodyRefused(413, "body_too_large", f"this request's body may be at most {limit} bytes")
    if _reading["bodies"] >= MAX_BODIES_READING:
        raise BodyRefused(503, "server_busy", "this server is reading too many request bodies; try again shortly")
    _reading["bodies"] += 1
    body = bytearray()
    try:
        async with asyncio.timeout(BODY_TIMEOUT_S):
            async for chunk in request.stream():
                body += chunk
                if len(body) > limit:
                    raise BodyRefused(413, "body_too_large", f"this request's body may be at most {limit} bytes")
    except TimeoutError:
        raise BodyRefused(408, "body_timeout", f"the request's body must arrive within {BODY_TIMEOUT_S:g} s") from None
    finally:
        _reading["bodies"] -= 1
    return bytes(body)


def _session_of(value, cfg, voices) -> dict | None:
    """A call's session object (an offer's ``session`` part, a client secret's), checked as
    ``session.update`` checks it: its known part, or BodyRefused 400 naming the bad field."""
    if value is None:
        return None
    try:
        return check_opening_session(value, cfg, voices)
    except (BadSetting, ClientEventError) as exc:
        code, message, param = realtime_refusal(exc)
        raise BodyRefused(400, code, message, param) from None


async def _offer(request: Request) -> tuple[str, object]:
    """The call's SDP offer and session value: an application/sdp body, or multipart with ``sdp``
    and ``session`` (JSON). Raises BodyRefused."""
    body = await _body(request, MAX_SDP_BYTES + MAX_SESSION_JSON_BYTES + MULTIPART_SLACK)
    if not request.headers.get("content-type", "").startswith("multipart/form-data"):
        if len(body) > MAX_SDP_BYTES:
            raise BodyRefused(413, "invalid_sdp", f"the offer must be at most {MAX_SDP_BYTES} bytes")
        return body.decode("utf-8", "replace"), None
    replayed = False

    async def receive():
        nonlocal replayed
        if replayed:
            return {"type": "http.disconnect"}
        replayed = True
        return {"type": "http.request", "body": body, "more_body": False}

    try:
        form = await Request(request.scope, receive).form(max_files=2, max_fields=8,
                                                          max_part_size=MAX_SESSION_JSON_BYTES)
    except HTTPException as exc:  # Starlette's refusal of a malformed or oversized form
        raise BodyRefused(400, "invalid_form", f"the multipart offer cannot be read: {exc.detail}") from None
    sdp, session = await _text(form.get("sdp"), MAX_SDP_BYTES, "sdp"), \
        await _text(form.get("session"), MAX_SESSION_JSON_BYTES, "session")
    try:
        session = json.loads(session) if session else None
    except (ValueError, RecursionError):
        raise BodyRefused(400, "invalid_session", "the session part must be a JSON object", "session") from None
    return sdp or "", session


async def _text(part, limit: int, name: str) -> str | None:
    """A form part as text: a field, or a part sent as a file (OpenAI's SDK sends ``sdp`` as one)."""
    if part is None or isinstance(part, str):
        data = None if part is None else part.encode()
    else:
        data = await part.read(limit + 1)
    if data is not None and len(data) > limit:
        raise BodyRefused(413, "body_too_large", f"the offer's {name} part must be at most {limit} bytes", name)
    return None if data is None else data.decode("utf-8", "replace")


@serve.deployment(ray_actor_options={"num_cpus": 0.25}, max_ongoing_requests=1000)
@serve.ingress(api)
class Gateway:
    def __init__(self, stt: DeploymentHandle, llm: DeploymentHandle, tts: DeploymentHandle, session: dict,
                 auth: dict, voices: tuple[str, ...] = ("default",), tickets: DeploymentHandle | None = None,
                 store: DeploymentHandle | None = None, phone: dict | None = None, webrtc: dict | None = None):
        metrics.serve_node_metrics()  # one replica of the node serves its metrics (pipeline/metrics.py)
        self.backends = RayBackends(stt, llm, tts)
        self.voices = tuple(voices)  # what a session may choose (the TTS replica's voices and their aliases)
        self.handles = {"stt": stt, "llm": llm, "tts": tts}
        self.tickets = tickets  # the redeemed-ticket record every gateway replica shares (deployments/tickets.py)
        self.session_cfg, self.limits = read_session_section(dict(session))
        for code in (P.E_INTERNAL, P.E_NO_FREE_SLOT, P.E_SERVER_BUSY, P.E_IDLE_TIMEOUT, P.E_TURN_TOO_LONG,
                     P.E_ENGINE_UNAVAILABLE, P.E_AUDIO_TOO_FAST):
            metrics.ERRORS.labels(code=code).inc(0)
        for by in ("smart_turn", "silence", "turn_end", "typed", "endpoint", "max_turn"):
            metrics.TURN_ENDS.labels(by=by).inc(0)
        # This replica's sessions, at most session.max_sessions; the gauge follows its count.
        self.sessions = SessionRegistry(self.limits.max_sessions, on_count=metrics.SESSIONS_ACTIVE.set)
        # v1 sessions are kept resumable in the store every gateway replica shares (deployments/session_store.py)
        window = self.limits.resume_window_s
        self.continuity = Continuity(RaySnapshots(store), window) if store is not None and window > 0 else None
        self._drain_watch: asyncio.Task | None = None
        # Who may come in (pipeline/door/admission.py): tokens are read here, in this process, from
        # the environment or file the config names; a token mode without tokens fails the start.
        auth_cfg = AuthConfig(**auth)
        self.phone = read_phone_section(phone)
        self.gate = Gatekeeper(Authenticator(auth_cfg, load_tokens(auth_cfg)),
                               ClientLimits(self.limits.max_sessions_per_client, self.limits.handshakes_per_minute),
                               max_waiting_streams=self.phone.unverified_streams)
        for code in ("unauthorized", "origin_not_allowed", "host_not_allowed", "too_many_handshakes",
                     "too_many_sessions"):
            metrics.HANDSHAKES_REFUSED.labels(code=code).inc(0)
        api.state.gate = self.gate  # the HTTP routes' Host check (_door)
        if os.environ.get(proxy_limits.ENV) != proxy_limits.CALLBACK:
            log.warning("%s is not %s in the environment Ray started in: the HTTP proxy reads WebSocket "
                        "messages up to uvicorn's 16 MiB before this gateway can refuse them, and holds "
                        "half-sent request heads (a venv made by scripts/install.sh sets it through a .pth: "
                        "run `python -m deployments.door_env install`, or export it before `serve run` / "
                        "`ray start`)", proxy_limits.ENV, proxy_limits.CALLBACK)
        if auth_cfg.mode == "none":
            log.warning("auth mode none: anyone who can reach this server's port can open sessions")
        self._phone_calls()
        self.webrtc = read_webrtc_section(webrtc)
        self.rtc_calls: dict[str, Peer] = {}  # this replica's WebRTC calls (a call is pinned to its replica)
        for direction in ("in", "out"):  # exported from the start, at 0
            metrics.WEBRTC_JITTER.labels(direction=direction)
            metrics.WEBRTC_PACKETS_LOST.labels(direction=direction).inc(0)
        for reason in ("not_public", "own_host", "name", "transport", "malformed"):
            metrics.WEBRTC_CANDIDATES_DROPPED.labels(reason=reason).inc(0)
        self._rtc_tasks: set[asyncio.Task] = set()
        # The turn-taking models load here, before the replica is ready, not on a first caller.
        warm_listening()
        self._health: asyncio.Future | None = None  # the last /healthz check (or the one in flight)
        self._health_at = 0.0
        self._app_name = serve.get_replica_context().app_name
        self._replica_tag = serve.get_replica_context().replica_tag.encode()

    def _phone_calls(self) -> None:
        """Phone calls (docs/phone.md): each carrier's call control and Twilio's webhook, where
        the environment holds the carrier's account."""
        self.call_controls = carriers_calls(self.phone)
        twilio = carrier_secrets(self.phone.twilio)
        self.twilio_webhook = None if twilio is None else TwilioWebhook(
            twilio[0], self._claim_once, lambda: self.gate.auth.issue()[0], self.phone.replay_window_s)
        for provider in DIALECTS:  # exported from the start, at 0
            metrics.CALLS.labels(provider=provider).inc(0)
            metrics.PHONE_PLAYBACK_DELAY.labels(provider=provider)
            metrics.PHONE_GAP.labels(provider=provider)

    @api.get("/healthz")
    async def healthz(self):
        """200 while every model deployment serves: a ``ready`` call to it answers, and Serve's
        controller reports it HEALTHY (every replica it should have is running; a replica that
        died and is being replaced makes it UNHEALTHY or UPDATING). 503 otherwise: before the
        models are warm, and during an outage. Checked at most once every HEALTH_TTL_S: callers
        meanwhile share the last check (or the one in flight), so no rate of calls fans out."""
        if self._health is None or time.monotonic() - self._health_at >= HEALTH_TTL_S:
            self._health, self._health_at = asyncio.ensure_future(self._check_health()), time.monotonic()
        body = await asyncio.shield(self._health)
        return JSONResponse(body, status_code=200 if body["ok"] else 503)

    async def _check_health(self) -> dict:
        names = list(self.handles)
        calls = [asyncio.wait_for(self.handles[n].ready.remote(), timeout=2.0) for n in names]
        results, states = await asyncio.gather(asyncio.gather(*calls, return_exceptions=True),
                                               self._serve_states())
        ready = {n: (r is True) for n, r in zip(names, results)}
        ok = all(ready.values()) and all(states.get(n, {}).get("status") == "HEALTHY" for n in names)
        return {"ok": ok, "deployments": ready, "serve": states}

    async def _serve_states(self) -> dict[str, dict]:
        """Each model deployment's status and replica states from Serve's controller; {} when it
        does not answer within 2 s, which /healthz counts as not healthy."""
        deployment_names = {"stt": "STT", "llm": "LLM", "tts": "TTS"}
        try:
            app = await asyncio.wait_for(asyncio.to_thread(_app_status, self._app_name), timeout=2.0)
        except Exception:  # noqa: BLE001 - the controller is busy or restarting
            return {}
        out = {}
        for key, dep in deployment_names.items():
            d = app.deployments.get(dep) if app else None
            if d is not None:
                out[key] = {"status": str(getattr(d.status, "value", d.status)), "replicas": dict(d.replica_states)}
        return out

    @api.get("/metrics")
    async def metrics(self, request: Request):
        """Prometheus scrape target: every deployment process of this node. Needs the bearer
        token where auth is on and auth.metrics_token is true (the default)."""
        try:
            self.gate.check_metrics(dict(request.headers))
        except Refused as refused:
            return _refusal_response(refused)
        return Response(metrics.exposition(), media_type=metrics.CONTENT_TYPE_LATEST)

    @api.get("/")
    async def page(self):
        """The browser client (web/index.html)."""
        return FileResponse(WEB_DIR / "index.html", headers=PAGE_HEADERS)

    @api.post("/v1/session")
    async def ticket(self, request: Request):
        """A single-use ticket for a browser's WebSocket handshake, for a bearer token
        (docs/protocol.md, "Authentication and limits")."""
        hs = Handshake(dict(request.headers), {}, self.gate.auth.address_of(request))
        try:
            return JSONResponse(self.gate.issue_ticket(hs), headers={"Cache-Control": "no-store"})
        except Refused as refused:
            metrics.HANDSHAKES_REFUSED.labels(code=refused.code).inc()
            return _refusal_response(refused)

    async def _serve_websocket(self, ws: WebSocket, serve, carrier: bool = False) -> None:
        """Check the handshake before the upgrade (pipeline.door.admission: refused, it gets an HTTP
        error instead), accept it, and hand it to ``serve(handshake, connection)``; the client's
        session place is given back however that ends. A ``carrier``'s stream brings its
        credential inside (a phone call's start: ``_verify_stream``)."""
        hs = Handshake(dict(ws.headers), dict(ws.query_params), self.gate.auth.address_of(ws))
        try:
            admission = self.gate.admit_stream(hs) if carrier else self.gate.admit(hs)
        except Refused as refused:
            metrics.HANDSHAKES_REFUSED.labels(code=refused.code).inc()
            await _deny(ws, refused)
            return
        try:  # from here on the place is given back however the connection ends, refused or not
            try:
                if not carrier:
                    await self._claim_ticket(hs)
            except Refused as refused:
                metrics.HANDSHAKES_REFUSED.labels(code=refused.code).inc()
                await _deny(ws, refused)
                return
            self._watch_for_drain()
            await ws.accept(headers=[(REPLICA_HEADER, self._replica_tag)])
            if carrier:  # its admission waits for the stream's start and credential
                await serve(hs, WebSocketConnection(ws), admission)
            else:
                await serve(hs, WebSocketConnection(ws))
        finally:
            admission.release()

    def _watch_for_drain(self) -> None:
        """From the first session on, watch for this replica being stopped (a redeploy, a scale-down)."""
        if self._drain_watch is None:
            self._drain_watch = asyncio.create_task(self._drain_when_stopping())

    async def _drain_when_stopping(self) -> None:
        """Ray Serve tells a replica nothing when it starts to stop it: it takes the replica out of
        routing, waits (up to graceful_shutdown_timeout_s) for its requests, each WebSocket one, to
        end, and only then calls ``__del__``. So this replica asks the controller for its own state
        every DRAIN_POLL_S; once it is STOPPING, every session is told to resume elsewhere
        (``going_away``, close 1012) and the wait for requests ends as soon as they have gone."""
        ctx = serve.get_replica_context()
        me = ctx.replica_id.unique_id
        controller = ray.get_actor(SERVE_CONTROLLER_NAME, namespace=SERVE_NAMESPACE)
        while True:
            await asyncio.sleep(DRAIN_POLL_S)
            try:
                details = await controller.get_deployment_details.remote(ctx.app_name, ctx.deployment)
            except Exception as exc:  # noqa: BLE001 - the controller restarts, or is busy: ask again
                log.debug("replica state unknown: %s", exc)
                continue
            state = next((r.state for r in details.replicas if r.replica_id == me), None)
            if state == ReplicaState.STOPPING:
                log.info("replica %s is stopping: draining %d sessions", me, len(self.sessions))
                left = await self.sessions.drain(DRAIN_TIMEOUT_S)
                log.info("replica %s drained (%d sessions left)", me, left)
                return

    async def _claim_ticket(self, hs: Handshake) -> None:
        """A ticket admitted here is also claimed in the shared ledger, so it opens one connection
        across all gateway replicas, not one on each (its signature and age were checked by admit).
        Used elsewhere: 401; the ledger unreachable: 503 (tickets fail closed; tokens go on)."""
        ticket = hs.query.get(TICKET_PARAM)
        if self.tickets is None or ticket is None or self.gate.auth.open:
            return
        try:  # a bearer token may have admitted the handshake: its ticket is checked all the same
            nonce, until = self.gate.auth.verify(ticket)
        except AuthError as exc:
            raise Refused("unauthorized", str(exc)) from None
        try:
            first = await asyncio.wait_for(self.tickets.claim.remote(nonce, until), timeout=2.0)
        except Exception:  # noqa: BLE001 - the ledger's replica is gone or busy
            raise Refused("server_busy", "tickets cannot be checked right now; try again shortly, "
                                         "or connect with the bearer token") from None
        if not first:
            raise Refused("unauthorized", "the ticket was already used; each ticket opens one connection")

    @api.websocket("/v1/conversation")
    async def conversation(self, ws: WebSocket) -> None:
        """Protocol v1 (docs/protocol.md). Admission, the receive loop, limits and clean-up of the
        session live in pipeline.connection (no Ray)."""
        async def serve(hs: Handshake, conn: WebSocketConnection) -> None:
            try:
                cfg = session_options(self.session_cfg, hs.session_query)
            except ValueError as exc:
                await refuse_options(conn, Session, str(exc))
                return
            resumption = None if self.continuity is None else \
                Resumption(self.continuity, self.gate.auth.principal(hs.headers, hs.query), hs.query)
            await serve_connection(conn, self.backends, cfg, self.sessions, Session, resumption,
                                   metrics.MetricsObserver(), voices=self.voices)

        await self._serve_websocket(ws, serve)

    @api.websocket("/v1/phone/{provider}")
    async def phone(self, ws: WebSocket, provider: str) -> None:
        """A phone carrier's media stream (docs/phone.md): ``twilio`` or ``telnyx``."""
        if provider not in DIALECTS:
            await ws.close(code=1008, reason=f"unknown carrier {provider[:40]!r}; known: {sorted(DIALECTS)}")
            return

        async def serve(hs: Handshake, conn: WebSocketConnection, admission) -> None:
            metrics.CALLS.labels(provider=provider).inc()
            await serve_call(conn, self.backends, self.session_cfg, self.sessions, provider, self._verify_stream,
                             admission, self.phone.start_within_s, metrics.MetricsObserver(), voices=self.voices,
                             phone=self.phone, calls=self.call_controls.get(provider))

        await self._serve_websocket(ws, serve, carrier=True)

    @api.post("/v1/phone/twilio/voice")
    async def twilio_voice(self, request: Request):
        """Twilio's voice webhook for an incoming call (pipeline/adapters/phone/twilio_webhook.py): TwiML that
        connects the call to /v1/phone/twilio with a one-use ticket, for a request Twilio signed."""
        if self.twilio_webhook is None:
            return JSONResponse({"error": {"code": "not_configured", "message": "phone.twilio is not configured, or "
                                           "its auth token is not set in the gateway's environment"}}, 404)
        try:
            body = await _body(request, MAX_FORM_BYTES)
        except BodyRefused as refused:
            return refused.response()
        form = dict(parse_qsl(body.decode("utf-8", "replace"), keep_blank_values=True))
        url = str(request.url)
        try:
            twiml = await self.twilio_webhook.answer(
                signed_url(self.phone.public_url, url), form, request.headers.get("x-twilio-signature"),
                stream_url(self.phone.public_url, url), dict(request.query_params))
        except WebhookRefused as refused:
            metrics.HANDSHAKES_REFUSED.labels(code="bad_signature").inc()
            return JSONResponse({"error": {"code": "forbidden", "message": refused.message}}, refused.status)
        return PlainTextResponse(twiml, media_type="application/xml", headers={"Cache-Control": "no-store"})

    async def _claim_once(self, nonce: str, until: float) -> bool:
        """True the first time ``nonce`` is claimed in the ledger every gateway replica shares."""
        if self.tickets is None:
            return self.gate.auth.redeemed.claim(nonce, until)
        try:
            return await asyncio.wait_for(self.tickets.claim.remote(nonce, until), timeout=2.0)
        except Exception:  # noqa: BLE001 - the ledger is gone or busy: nothing is answered twice
            return False

    async def _verify_stream(self, credential: str | None) -> bool:
        """A call stream's credential (its start parameter ``ticket``): a one-use ticket (claimed in
        the shared ledger, as a handshake's) or a bearer token of this server."""
        if self.gate.auth.open:
            return True
        if not credential:
            return False
        try:
            self.gate.auth.check({}, {TICKET_PARAM: credential})
        except AuthError:
            try:
                self.gate.auth.check({"authorization": f"Bearer {credential}"}, {})
                return True
            except AuthError:
                return False
        try:
            await self._claim_ticket(Handshake({}, {TICKET_PARAM: credential}, ""))
        except Refused:
            return False
        return True

    @api.websocket("/v1/realtime")
    async def realtime(self, ws: WebSocket) -> None:
        """The OpenAI Realtime protocol (docs/realtime.md) on the same conversation core, with the
        same admission and limits. ``?model=`` is echoed in the session; ``OpenAI-Beta:
        realtime=v1`` selects the beta event names."""
        async def serve(hs: Handshake, conn: WebSocketConnection) -> None:
            await serve_connection(conn, self.backends, self.session_cfg, self.sessions, RealtimeSession,
                                   observer=metrics.MetricsObserver(), voices=self.voices, model=hs.query.get("model") or "gapless",
                                   beta="realtime=v1" in hs.headers.get("openai-beta", ""))

        await self._serve_websocket(ws, serve)

    # ------------------------------------------------------------------ WebRTC (docs/webrtc.md)
    @api.post("/v1/realtime/client_secrets")
    async def client_secrets(self, request: Request):
        """An ephemeral key for a browser's WebRTC call, as OpenAI's client_secrets: a one-use
        ticket, for a bearer token. The browser sends it as its Bearer on POST /v1/realtime/calls."""
        hs = Handshake(dict(request.headers), {}, self.gate.auth.address_of(request))
        try:  # the credential first, then the body; the key is issued only for a good one of each
            self.gate.check_ticket_request(hs)
            body = await _body(request, MAX_SESSION_JSON_BYTES + 1024)
            try:
                request_object = json.loads(body) if body.strip() else {}
            except (ValueError, RecursionError):
                raise BodyRefused(400, "invalid_json", "the body must be a JSON object") from None
            if not isinstance(request_object, dict):
                raise BodyRefused(400, "invalid_json", "the body must be a JSON object")
            session = _session_of(request_object.get("session"), self.session_cfg, self.voices)
            issued = self.gate.issue_ticket(hs)
        except Refused as refused:
            metrics.HANDSHAKES_REFUSED.labels(code=refused.code).inc()
            return _refusal_response(refused)
        except BodyRefused as refused:
            return refused.response()
        return JSONResponse({"value": issued["ticket"], "expires_at": int(time.time() + issued["expires_in_s"]),
                             "session": session or {}}, headers={"Cache-Control": "no-store"})

    @api.post("/v1/realtime/calls")
    async def realtime_call(self, request: Request):
        """A WebRTC call (OpenAI's interface): an SDP offer, raw (application/sdp) or multipart with
        ``sdp`` and ``session``; 201 with the SDP answer and the call's Location. The credential is
        a Bearer token or an ephemeral key from /v1/realtime/client_secrets."""
        hs = self._call_handshake(request)
        try:
            admission = self.gate.admit(hs)
        except Refused as refused:
            metrics.HANDSHAKES_REFUSED.labels(code=refused.code).inc()
            return _refusal_response(refused)
        peer = None
        try:
            await self._claim_ticket(hs)
            if self.sessions.full or self.sessions.draining:
                raise Refused(P.E_SERVER_BUSY, "this server is at its session limit; try again shortly")
            offer, session = await _offer(request)
            session = _session_of(session, self.session_cfg, self.voices)  # before any peer exists
            peer = Peer(self.webrtc.ice_servers, on_stats=metrics.webrtc_stats, policy=self.webrtc.policy)
            answer = await peer.answer(offer)
            for reason, count in peer.dropped_candidates.items():
                metrics.WEBRTC_CANDIDATES_DROPPED.labels(reason=reason).inc(count)
        except BodyRefused as refused:
            admission.release()
            return refused.response()
        except Refused as refused:
            admission.release()
            metrics.HANDSHAKES_REFUSED.labels(code=refused.code).inc()
            return _refusal_response(refused)
        except OfferRefused as refused:
            admission.release()
            return JSONResponse({"error": {"type": "invalid_request_error", "code": refused.code,
                                           "message": refused.message}}, refused.status)
        except BaseException:  # the client went away mid-answer (a cancel): nothing of the call stays
            admission.release()
            if peer is not None:
                asyncio.ensure_future(peer.close())
            raise
        metrics.WEBRTC_CALLS.inc()
        self.rtc_calls[peer.id] = peer
        task = asyncio.create_task(self._serve_call(peer, admission, session, hs.query.get("model")))
        self._rtc_tasks.add(task)
        task.add_done_callback(self._rtc_tasks.discard)
        return Response(answer, status_code=201, media_type="application/sdp",
                        headers={"Location": f"/v1/realtime/calls/{peer.id}"})

    def _call_handshake(self, request: Request) -> Handshake:
        """The call's handshake; an ephemeral key (a ticket) sent as the Bearer is checked as a ticket."""
        headers, query = dict(request.headers), dict(request.query_params)
        token = bearer(headers)
        if token is not None and not self.gate.auth.token_ok(token) and token.count(".") == 3:
            headers = {k: v for k, v in headers.items() if k != "authorization"}
            query[TICKET_PARAM] = token
        return Handshake(headers, query, self.gate.auth.address_of(request))

    async def _serve_call(self, peer: Peer, admission, session: dict | None, model: str | None) -> None:
        try:
            await serve_connection(peer, self.backends, self.session_cfg, self.sessions, WebRTCSession,
                                   observer=metrics.MetricsObserver(), voices=self.voices, model=model or "gapless",
                                   peer=peer, session=session)
        finally:
            admission.release()
            self.rtc_calls.pop(peer.id, None)
            await peer.close()

    @api.post("/v1/realtime/calls/{call_id}/hangup")
    async def hang_up_call(self, call_id: str, request: Request):
        """End a WebRTC call held by this gateway replica (closing the peer connection ends it too)."""
        try:
            self.gate.auth.require_token(dict(request.headers))
        except AuthError as exc:
            return _refusal_response(Refused("unauthorized", str(exc)))
        peer = self.rtc_calls.get(call_id)
        if peer is None:
            return JSONResponse({"error": {"code": "call_not_found", "message": f"no call {call_id[:40]!r} on this "
                                           "gateway replica (a call is held by the replica that answered it)"}}, 404)
        await peer.close()
        return Response(status_code=200)

