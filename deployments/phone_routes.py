"""The gateway's phone routes (docs/phone.md): carriers' media streams, Twilio's voice webhook, and
the stream credentials they carry. A mixin of :class:`deployments.gateway.Gateway`."""
# No `from __future__ import annotations` here: FastAPI must see the real WebSocket type
# through Ray Serve's class-based view, or the WebSocket route rejects every handshake (403).
import asyncio
from urllib.parse import parse_qsl

from fastapi import Request, WebSocket
from fastapi.responses import JSONResponse, PlainTextResponse

from deployments.bodies import BodyRefused, read_body
from deployments.ingress import WebSocketConnection, api
from pipeline import metrics
from pipeline.adapters.phone.adapter import serve_call
from pipeline.adapters.phone.carriers import DIALECTS
from pipeline.adapters.phone.config import carrier_secrets, carriers_calls
from pipeline.adapters.phone.twilio_webhook import TwilioWebhook, WebhookRefused, signed_url, stream_url
from pipeline.door.admission import Handshake, Refused
from pipeline.door.auth import TICKET_PARAM, AuthError
from pipeline.door.bodies import MAX_FORM_BYTES
from pipeline.records.store import CARRIER


class PhoneRoutes:
    def _phone_calls(self) -> None:
        """Phone calls (docs/phone.md): each carrier's call control and Twilio's webhook, where
        the environment holds the carrier's account."""
        self.call_controls = carriers_calls(self.phone)
        twilio = carrier_secrets(self.phone.twilio)
        self.twilio_webhook = None if twilio is None else TwilioWebhook(
            twilio[0], self._claim_once, lambda: self.gate.auth.issue()[0], self.phone.replay_window_s)

    @api.websocket("/v1/phone/{provider}")
    async def phone(self, ws: WebSocket, provider: str) -> None:
        """A phone carrier's media stream (docs/phone.md): ``twilio`` or ``telnyx``."""
        if provider not in DIALECTS:
            await ws.close(code=1008, reason=f"unknown carrier {provider[:40]!r}; known: {sorted(DIALECTS)}")
            return

        async def serve(hs: Handshake, conn: WebSocketConnection, admission) -> None:
            metrics.CALLS.labels(provider=provider).inc()
            await serve_call(conn, self.backends, self.session_cfg, self.sessions, provider, self._verify_stream,
                             admission, self.phone.start_within_s, metrics.MetricsObserver("phone"),
                             recording=self.recording(None, "phone", CARRIER), voices=self.voices,
                             offer=self.offer,
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
            body = await read_body(request, MAX_FORM_BYTES)
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
