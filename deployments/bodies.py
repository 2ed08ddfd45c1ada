"""Request bodies as the gateway reads them: declared or chunked, no further than a cap, within
the body deadline, and at most MAX_BODIES_READING at once on a replica (pipeline/door/bodies.py
has the bounds; the proxy enforces them before a request reaches here)."""
import asyncio
from collections import Counter

from fastapi import Request
from fastapi.responses import JSONResponse

from pipeline.door.bodies import BODY_TIMEOUT_S, MAX_BODIES_READING


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


reading = Counter()  # "bodies": the request bodies this replica is reading now


async def read_body(request: Request, limit: int) -> bytes:
    """The request's body, declared or chunked, read no further than ``limit`` bytes and within
    BODY_TIMEOUT_S, at most MAX_BODIES_READING at once on this replica (pipeline/door/bodies.py).
    The proxy's body limits hold anonymous bodies to the same before this runs; a body with a
    credential streams on to here, and auth mode none checks no credential."""
    declared = request.headers.get("content-length") or ""
    if declared.isdigit() and int(declared) > limit:
        raise BodyRefused(413, "body_too_large", f"this request's body may be at most {limit} bytes")
    if reading["bodies"] >= MAX_BODIES_READING:
        raise BodyRefused(503, "server_busy", "this server is reading too many request bodies; try again shortly")
    reading["bodies"] += 1
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
        reading["bodies"] -= 1
    return bytes(body)
