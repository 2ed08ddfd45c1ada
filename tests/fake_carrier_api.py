"""A local fake of the carriers' REST APIs that call control uses (Twilio's Calls resource,
Telnyx's call actions), written from their documentation: it records each request and answers
as the real API does, enough for the official clients (``twilio``, ``telnyx``) to accept it.

    api = FakeCarrierAPI().start()      # a thread on a free loopback port
    api.url                             # phone.twilio.api_base_url / phone.telnyx.api_base_url (+ "/v2")
    api.requests                        # [(method, path, form or JSON body)], in order
"""
from __future__ import annotations

import json
import re
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qsl

TWILIO_CALL = re.compile(r"^/2010-04-01/Accounts/(AC\w+)/Calls/(CA\w+)\.json$")
TELNYX_ACTION = re.compile(r"^/v2/calls/([^/]+)/actions/(hangup|transfer)$")


class FakeCarrierAPI:
    def __init__(self, port: int = 0):
        self.requests: list[tuple[str, str, dict]] = []
        self.arrived: list[float] = []  # time.monotonic() of each request
        self.fail = False  # answer 500 (a carrier outage)
        self._changed = threading.Condition()
        api = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 - http.server's name
                body = self.rfile.read(int(self.headers.get("content-length") or 0)).decode()
                is_json = "json" in (self.headers.get("content-type") or "")
                fields = json.loads(body or "{}") if is_json else dict(parse_qsl(body))
                with api._changed:
                    api.arrived.append(time.monotonic())
                    api.requests.append(("POST", self.path, fields))
                    api._changed.notify_all()
                if api.fail:
                    return self._answer(500, {"code": 20500, "message": "fake outage", "status": 500})
                twilio, telnyx = TWILIO_CALL.match(self.path), TELNYX_ACTION.match(self.path)
                if twilio:
                    status = "completed" if fields.get("Status") == "completed" else "in-progress"
                    return self._answer(200, {"sid": twilio.group(2), "account_sid": twilio.group(1),
                                              "status": status})
                if telnyx:
                    return self._answer(200, {"data": {"result": "ok"}})
                self._answer(404, {"message": f"no such resource {self.path}"})

            def _answer(self, status: int, body: dict) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):  # quiet
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def start(self) -> "FakeCarrierAPI":
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def wait_for(self, predicate, timeout: float = 30.0) -> list[tuple[str, str, dict]]:
        """Block until ``predicate(requests)`` holds (or raise TimeoutError)."""
        with self._changed:
            if not self._changed.wait_for(lambda: predicate(self.requests), timeout):
                raise TimeoutError(f"the fake carrier API saw {self.requests}")
            return list(self.requests)
