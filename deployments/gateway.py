"""Gateway deployment: the ingress that holds the sessions (models live elsewhere). Its routes: the
conversation WebSockets (protocol v1, the Realtime protocol), tickets, health and metrics here;
the phone's in deployments/phone_routes.py, WebRTC signalling in deployments/webrtc_routes.py;
the HTTP app and its door in deployments/ingress.py; the engines through deployments/backends.py."""
# No `from __future__ import annotations` here: FastAPI must see the real WebSocket type
# through Ray Serve's class-based view, or the WebSocket route rejects every handshake (403).
import asyncio
import logging
import os
import time

import ray
from fastapi import Request, WebSocket
from fastapi.responses import FileResponse, JSONResponse, Response
from ray import serve
from ray.serve._private.common import ReplicaState
from ray.serve._private.constants import SERVE_CONTROLLER_NAME, SERVE_NAMESPACE
from ray.serve.handle import DeploymentHandle

from deployments import proxy_limits
from deployments.backends import RayBackends
from deployments.ingress import PAGE_HEADERS, WEB_DIR, WebSocketConnection, api, deny, refusal_response
from deployments.phone_routes import PhoneRoutes
from deployments.session_store import RayRecords, RaySnapshots
from deployments.webrtc_routes import WebRTCRoutes
from pipeline import metrics
from pipeline.conversation.voice_offer import VoiceOffer
from pipeline.adapters.phone.config import read_phone_section
from pipeline.adapters.realtime.adapter import RealtimeSession
from pipeline.adapters.v1.adapter import Session
from pipeline.adapters.v1.options import refuse_options, session_options
from pipeline.adapters.webrtc.config import read_webrtc_section
from pipeline.connection import Recording, Resumption, SessionRegistry, serve_connection
from pipeline.conversation.ears.listening import warm_listening
from pipeline.door.admission import Gatekeeper, Handshake, Refused
from pipeline.door.auth import TICKET_PARAM, AuthConfig, AuthError, Authenticator, load_tokens
from pipeline.door.client_limits import ClientLimits
from pipeline.resume.keeper import Continuity
from pipeline.session_config import read_session_section

log = logging.getLogger(__name__)
# A stopping replica notices within DRAIN_POLL_S and gives its sessions DRAIN_TIMEOUT_S to leave;
# its deployment's graceful_shutdown_timeout_s (serve configs) must exceed both together.
DRAIN_POLL_S = 0.5
DRAIN_TIMEOUT_S = 10.0
HEALTH_TTL_S = 1.0  # /healthz asks the model replicas and Serve's controller at most this often
# The accepted WebSocket names the gateway replica serving it (which one holds a call, after a resume).
REPLICA_HEADER = b"x-gapless-replica"
MAX_SESSION_ID = 64  # a session id is "sess_" and 20 hex digits: a longer ask is cut before the store sees it

def _app_status(app_name: str):
    """This application's status from Serve's controller (a blocking call: run it in a thread)."""
    return serve.status().applications.get(app_name)


def _warn_about_the_door(auth: AuthConfig) -> None:
    """What an operator must hear at start: the proxy's limits missing, a server open to anyone."""
    if os.environ.get(proxy_limits.ENV) != proxy_limits.CALLBACK:
        log.warning("%s is not %s in the environment Ray started in: the HTTP proxy reads WebSocket "
                    "messages up to uvicorn's 16 MiB before this gateway can refuse them, holds half-sent "
                    "request heads and reads request bodies without bound (a venv made by scripts/install.sh "
                    "sets it through a .pth: run `python -m deployments.door_env install`, or export it "
                    "before `serve run` / `ray start`)", proxy_limits.ENV, proxy_limits.CALLBACK)
    if auth.mode == "none":
        log.warning("auth mode none: anyone who can reach this server's port can open sessions")


@serve.deployment(ray_actor_options={"num_cpus": 0.25}, max_ongoing_requests=1000)
@serve.ingress(api)
class Gateway(PhoneRoutes, WebRTCRoutes):
    def __init__(self, stt: DeploymentHandle, llm: DeploymentHandle, tts: DeploymentHandle, session: dict,
                 auth: dict, voices: tuple[str, ...] = ("default",), tickets: DeploymentHandle | None = None,
                 store: DeploymentHandle | None = None, phone: dict | None = None, webrtc: dict | None = None,
                 offer: VoiceOffer | None = None, words: DeploymentHandle | None = None):
        metrics.serve_node_metrics()  # one replica of the node serves its metrics (pipeline/metrics.py)
        self.offer = offer or VoiceOffer()  # what the recogniser hears, and which voice speaks what
        self.backends = RayBackends(stt, llm, tts, words, self.offer.word_voices)  # words: DSM's deployment
        self.voices = tuple(voices)  # what a session may choose (the TTS replica's voices and their aliases)
        # The model deployments by name, lower case (stt, llm, tts, and a second TTS family's tts_<family>)
        self.handles = {h.deployment_name.lower(): h for h in (stt, llm, tts, words) if h is not None}
        self.tickets = tickets  # the redeemed-ticket record every gateway replica shares (deployments/tickets.py)
        self.session_cfg, self.limits = read_session_section(dict(session))
        metrics.export_gateway_series()  # at 0 from the start, so dashboards and alerts see them
        # This replica's sessions, at most session.max_sessions; the gauge follows its count.
        self.sessions = SessionRegistry(self.limits.max_sessions, on_count=metrics.SESSIONS_ACTIVE.set)
        # v1 sessions are kept resumable in the store every gateway replica shares (deployments/session_store.py)
        window = self.limits.resume_window_s
        self.continuity = Continuity(RaySnapshots(store), window) if store is not None and window > 0 else None
        self.records = RayRecords(store) if store is not None else None  # every session's call record
        self._drain_watch: asyncio.Task | None = None
        # Who may come in (pipeline/door/admission.py): tokens are read here, in this process, from
        # the environment or file the config names; a token mode without tokens fails the start.
        auth_cfg = AuthConfig(**auth)
        self.phone = read_phone_section(phone)
        self.gate = Gatekeeper(Authenticator(auth_cfg, load_tokens(auth_cfg)),
                               ClientLimits(self.limits.max_sessions_per_client, self.limits.handshakes_per_minute),
                               max_waiting_streams=self.phone.unverified_streams)
        api.state.gate = self.gate  # the HTTP routes' Host check (_door)
        _warn_about_the_door(auth_cfg)
        self._phone_calls()
        self.webrtc = read_webrtc_section(webrtc)
        self.rtc_calls: dict[str, object] = {}  # this replica's WebRTC calls' peers (a call is pinned to its replica)
        self._rtc_tasks: set[asyncio.Task] = set()
        # The turn-taking models load here, before the replica is ready, not on a first caller.
        warm_listening()
        self._health: asyncio.Future | None = None  # the last /healthz check (or the one in flight)
        self._health_at = 0.0
        self._app_name = serve.get_replica_context().app_name
        self._replica_tag = serve.get_replica_context().replica_tag.encode()

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
        try:
            app = await asyncio.wait_for(asyncio.to_thread(_app_status, self._app_name), timeout=2.0)
        except Exception:  # noqa: BLE001 - the controller is busy or restarting
            return {}
        out = {}
        for key, handle in self.handles.items():
            d = app.deployments.get(handle.deployment_name) if app else None
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
            return refusal_response(refused)
        return Response(metrics.exposition(), media_type=metrics.CONTENT_TYPE_LATEST)

    def recording(self, hs: Handshake | None, transport: str, principal: str | None = None) -> Recording | None:
        """Where a session's call record is kept, as the principal of its handshake ``hs``."""
        if self.records is None:
            return None
        return Recording(self.records, principal or self.gate.auth.principal(hs.headers, hs.query), transport)

    @api.get("/v1/sessions/{session_id}/record")
    async def call_record(self, session_id: str, request: Request):
        """A session's call record (docs/observability.md), for the principal the session had."""
        hs = Handshake(dict(request.headers), {}, self.gate.auth.address_of(request))
        try:
            self.gate.check_ticket_request(hs)
        except Refused as refused:
            return refusal_response(refused)
        blob = None if self.records is None else await self.records.get_record(
            session_id[:MAX_SESSION_ID], self.gate.auth.principal(hs.headers, {}))
        if blob is None:
            return JSONResponse({"error": {"code": "record_not_found", "message": f"no record of session "
                                           f"{session_id[:64]!r} for this client (records are kept "
                                           "for a day, and each is its own session's)"}}, 404)
        return Response(blob, media_type="application/json", headers={"Cache-Control": "no-store"})

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
            return refusal_response(refused)

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
            await deny(ws, refused)
            return
        try:  # from here on the place is given back however the connection ends, refused or not
            try:
                if not carrier:
                    await self._claim_ticket(hs)
            except Refused as refused:
                metrics.HANDSHAKES_REFUSED.labels(code=refused.code).inc()
                await deny(ws, refused)
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
                                   metrics.MetricsObserver("v1"), self.recording(hs, "v1"), voices=self.voices,
                                   offer=self.offer)

        await self._serve_websocket(ws, serve)

    @api.websocket("/v1/realtime")
    async def realtime(self, ws: WebSocket) -> None:
        """The OpenAI Realtime protocol (docs/realtime.md) on the same conversation core, with the
        same admission and limits. ``?model=`` is echoed in the session; ``OpenAI-Beta:
        realtime=v1`` selects the beta event names."""
        async def serve(hs: Handshake, conn: WebSocketConnection) -> None:
            await serve_connection(conn, self.backends, self.session_cfg, self.sessions, RealtimeSession,
                                   observer=metrics.MetricsObserver("realtime"), recording=self.recording(hs, "realtime"),
                                   voices=self.voices, offer=self.offer, model=hs.query.get("model") or "gapless",
                                   beta="realtime=v1" in hs.headers.get("openai-beta", ""))

        await self._serve_websocket(ws, serve)
