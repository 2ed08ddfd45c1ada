"""The phone and WebRTC doors with auth on (conftest.py: tokens, Twilio's webhook configured):
the attacks of tests/door_attacks.py at once beside a token holder's v1 conversation, from one of
the silent carrier streams' own addresses. The same assertions as with auth off
(tests/e2e/test_door.py)."""
from __future__ import annotations

import asyncio

from tests import door_attacks as A
from tests.e2e.test_door import _assert_doors_held, _doors


def test_the_phone_and_webrtc_doors_hold_with_auth_on_beside_a_token_holder(auth_server):
    target = A.Target("https", token=auth_server.token)
    results, gaps, before, after = asyncio.run(asyncio.wait_for(_doors(A, target), 300))
    _assert_doors_held(A, target, results, gaps, before, after)
