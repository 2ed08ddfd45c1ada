"""The gateway's HTTP app, shared by its routes (deployments/gateway.py, phone_routes.py,
webrtc_routes.py): the FastAPI app Serve's ingress wraps, the door every HTTP route passes (the
``Host`` check, the web page's security headers), the refusals' answers, and a Starlette
WebSocket as the Connection a session is served over."""
# No `from __future__ import annotations` here: FastAPI must see the real WebSocket type
# through Ray Serve's class-based view, or the WebSocket route rejects every handshake (403).
from importlib import resources
from pathlib import Path

from fastapi import FastAPI, Request, WebSocket
from fastapi.responses import JSONResponse
from fastapi.staticfiles import StaticFiles
from starlette.websockets import WebSocketDisconnect

from pipeline import errors
from pipeline import metrics
from pipeline.door.admission import Refused
from pipeline.engines import ClientGone

api = FastAPI(title="gapless", docs_url=None, redoc_url=None, openapi_url=None)

# The browser client (web/): plain files, no build step. Its scripts come from this origin only.
# It travels as the package data of deployments (deployments/web links to web/ in a checkout; a
# wheel holds the files), found as a resource either way.
WEB_DIR = Path(str(resources.files("deployments") / "web"))
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
            return refusal_response(refused)
    response = await call_next(request)
    if request.url.path.startswith("/web/"):
        response.headers.update(PAGE_HEADERS)
    return response


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


def refusal_response(refused: Refused) -> JSONResponse:
    headers = {"WWW-Authenticate": "Bearer"} if refused.status == 401 else {}
    return JSONResponse(refused.body(), status_code=refused.status, headers=headers)


async def deny(ws: WebSocket, refused: Refused) -> None:
    """Answer a handshake with an HTTP error instead of the upgrade. Where the server does not
    offer ASGI's denial-response extension, closing before accepting makes it answer 403."""
    try:
        await ws.send_denial_response(refusal_response(refused))
    except RuntimeError:
        await ws.close(code=errors.CLOSE_POLICY_VIOLATION)
