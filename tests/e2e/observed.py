"""What an operator sees of the served app: a histogram's count on /metrics, and a session's
call record (GET /v1/sessions/{id}/record), for the end-to-end tests."""
from __future__ import annotations

import json
import time
import urllib.error
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from tests.e2e.serve_process import PORT

BASE = f"http://127.0.0.1:{PORT}"


def count(name: str, **labels: str) -> float:
    """The ``_count`` of histogram ``name`` with ``labels``, summed over the node's processes."""
    with urllib.request.urlopen(f"{BASE}/metrics", timeout=10) as r:
        text = r.read().decode()
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == f"{name}_count" and all(s.labels.get(k) == v for k, v in labels.items()))


def record(session_id: str, until, timeout: float = 20.0, token: str | None = None) -> dict:
    """The session's call record once ``until(record)`` holds (it is put beside the conversation,
    at most every 2 s, and at the connection's end). AssertionError if it does not in ``timeout``."""
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    deadline, last = time.monotonic() + timeout, None
    while time.monotonic() < deadline:
        request = urllib.request.Request(f"{BASE}/v1/sessions/{session_id}/record", headers=headers)
        try:
            with urllib.request.urlopen(request, timeout=10) as r:
                last = json.loads(r.read())
        except urllib.error.HTTPError as e:
            if e.code != 404:
                raise
        if last is not None and until(last):
            return last
        time.sleep(0.25)  # polling the store for the record's next put
    raise AssertionError(f"the record of {session_id} did not show what was expected within {timeout} s: {last}")


def replies(rec: dict) -> list[dict]:
    return [r for t in rec["turns"] for r in t["replies"]]
