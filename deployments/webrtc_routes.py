"""The gateway's WebRTC signalling (docs/webrtc.md), as OpenAI's interface has it: ephemeral keys,
the offer (a raw SDP, or multipart with a session object) and its answer, the hang-up. A call's
peer connection lives in the replica that answered it. A mixin of
:class:`deployments.gateway.Gateway`."""
# No `from __future__ import annotations` here (FastAPI reads the route signatures).
import asyncio
import json
import logging
import time

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException

from deployments.bodies import BodyRefused, read_body
from deployments.ingress import api, refusal_response
from pipeline import errors
from pipeline import metrics
from pipeline.adapters.realtime.adapter import check_opening_session
from pipeline.adapters.realtime.adapter import refusal as realtime_refusal
from pipeline.adapters.realtime.client_events import ClientEventError
from pipeline.connection import serve_connection
from pipeline.conversation.agent import BadSetting
from pipeline.door.admission import Handshake, Refused
from pipeline.door.auth import TICKET_PARAM, AuthError, bearer
from pipeline.door.bodies import MAX_SDP_BYTES, MAX_SESSION_JSON_BYTES, MULTIPART_SLACK

WEBRTC_EXTRA = {"aiortc", "av", "aioice"}  # the webrtc extra's packages
try:  # without the extra every call is answered 501, and nothing else changes
    from pipeline.adapters.webrtc import adapter as rtc_adapter
    from pipeline.adapters.webrtc import peer as rtc_peer
except ModuleNotFoundError as missing:
    if (missing.name or "").split(".")[0] not in WEBRTC_EXTRA:
        raise  # a broken install or a bug is not "not installed"
    logging.getLogger(__name__).warning("WebRTC calls are answered 501: %s is not installed (pip install "
                                        "'gapless[webrtc]')", missing.name)
    rtc_adapter = rtc_peer = None


def _session_of(value, cfg, voices, offer) -> dict | None:
    """A call's session object (an offer's ``session`` part, a client secret's), checked as
    ``session.update`` checks it: its known part, or BodyRefused 400 naming the bad field."""
    if value is None:
        return None
    try:
        return check_opening_session(value, cfg, voices, offer)
    except (BadSetting, ClientEventError) as exc:
        code, message, param = realtime_refusal(exc)
        raise BodyRefused(400, code, message, param) from None


async def _offer(request: Request) -> tuple[str, object]:
    """The call's SDP offer and session value: an application/sdp body, or multipart with ``sdp``
    and ``session`` (JSON). Raises BodyRefused."""
    body = await read_body(request, MAX_SDP_BYTES + MAX_SESSION_JSON_BYTES + MULTIPART_SLACK)
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


class WebRTCRoutes:
    @api.post("/v1/realtime/client_secrets")
    async def client_secrets(self, request: Request):
        """An ephemeral key for a browser's WebRTC call, as OpenAI's client_secrets: a one-use
        ticket, for a bearer token. The browser sends it as its Bearer on POST /v1/realtime/calls."""
        hs = Handshake(dict(request.headers), {}, self.gate.auth.address_of(request))
        try:  # the credential first, then the body; the key is issued only for a good one of each
            self.gate.check_ticket_request(hs)
            body = await read_body(request, MAX_SESSION_JSON_BYTES + 1024)
            try:
                request_object = json.loads(body) if body.strip() else {}
            except (ValueError, RecursionError):
                raise BodyRefused(400, "invalid_json", "the body must be a JSON object") from None
            if not isinstance(request_object, dict):
                raise BodyRefused(400, "invalid_json", "the body must be a JSON object")
            session = _session_of(request_object.get("session"), self.session_cfg, self.voices, self.offer)
            issued = self.gate.issue_ticket(hs)
        except Refused as refused:
            metrics.HANDSHAKES_REFUSED.labels(code=refused.code).inc()
            return refusal_response(refused)
        except BodyRefused as refused:
            return refused.response()
        return JSONResponse({"value": issued["ticket"], "expires_at": int(time.time() + issued["expires_in_s"]),
                             "session": session or {}}, headers={"Cache-Control": "no-store"})

    @api.post("/v1/realtime/calls")
    async def realtime_call(self, request: Request):
        """A WebRTC call (OpenAI's interface): an SDP offer, raw (application/sdp) or multipart with
        ``sdp`` and ``session``; 201 with the SDP answer and the call's Location. The credential is
        a Bearer token or an ephemeral key from /v1/realtime/client_secrets."""
        # Over 40 lines as one function: admission, the offer, the answer: each refusal gives the admission back.
        if rtc_peer is None:
            return JSONResponse({"error": {"type": "invalid_request_error", "code": "webrtc_not_installed",
                                           "message": "this server has no WebRTC: pip install 'gapless[webrtc]'"}}, 501)
        hs = self._call_handshake(request)
        try:
            admission = self.gate.admit(hs)
        except Refused as refused:
            metrics.HANDSHAKES_REFUSED.labels(code=refused.code).inc()
            return refusal_response(refused)
        peer = None
        try:
            await self._claim_ticket(hs)
            if self.sessions.full or self.sessions.draining:
                raise Refused(errors.E_SERVER_BUSY, "this server is at its session limit; try again shortly")
            offer, session = await _offer(request)
            session = _session_of(session, self.session_cfg, self.voices, self.offer)  # before any peer exists
            peer = rtc_peer.Peer(self.webrtc.ice_servers, on_stats=metrics.webrtc_stats, policy=self.webrtc.policy)
            answer = await peer.answer(offer)
            for reason, count in peer.dropped_candidates.items():
                metrics.WEBRTC_CANDIDATES_DROPPED.labels(reason=reason).inc(count)
        except BodyRefused as refused:
            admission.release()
            return refused.response()
        except Refused as refused:
            admission.release()
            metrics.HANDSHAKES_REFUSED.labels(code=refused.code).inc()
            return refusal_response(refused)
        except rtc_peer.OfferRefused as refused:
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
        recording = self.recording(hs, "webrtc")
        task = asyncio.create_task(self._serve_call(peer, admission, session, hs.query.get("model"), recording))
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

    async def _serve_call(self, peer, admission, session: dict | None, model: str | None, recording=None) -> None:
        try:
            await serve_connection(peer, self.backends, self.session_cfg, self.sessions, rtc_adapter.WebRTCSession,
                                   observer=metrics.MetricsObserver("webrtc"), recording=recording,
                                   voices=self.voices, offer=self.offer, model=model or "gapless",
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
            return refusal_response(Refused("unauthorized", str(exc)))
        peer = self.rtc_calls.get(call_id)
        if peer is None:
            return JSONResponse({"error": {"code": "call_not_found", "message": f"no call {call_id[:40]!r} on this "
                                           "gateway replica (a call is held by the replica that answered it)"}}, 404)
        await peer.close()
        return Response(status_code=200)
