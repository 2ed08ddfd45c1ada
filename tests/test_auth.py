"""Authentication, origins and per-client limits, without Ray (pipeline/door/auth.py, admission.py,
client_limits.py); the same checks through the real server are in tests/e2e_auth."""
from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml

from pipeline.door.admission import Gatekeeper, Handshake, Refused
from pipeline.door.auth import AuthConfig, AuthError, Authenticator, bearer, host_allowed, load_tokens, origin_allowed
from pipeline.door.client_limits import ClientLimits, LimitExceeded

ROOT = Path(__file__).resolve().parents[1]
TOKEN = "tok-0123456789abcdef-one"
OTHER = "tok-0123456789abcdef-two"


class Clock:
    def __init__(self, t: float = 1_000_000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


def auth(tokens=(TOKEN,), clock=None, **cfg) -> Authenticator:
    cfg.setdefault("allowed_hosts", ("h",))  # the gate tests' server is "h"
    return Authenticator(AuthConfig(**cfg), tuple(tokens), clock=clock or Clock())


# ------------------------------------------------------------------ tokens
def test_tokens_come_from_the_environment_and_a_file(tmp_path):
    f = tmp_path / "tokens"
    f.write_text(f"# the ops team\n{OTHER}\n\n")
    cfg = AuthConfig(tokens_env="MY_TOKENS", tokens_file=str(f))
    assert load_tokens(cfg, {"MY_TOKENS": f"{TOKEN}, {TOKEN}"}) == (TOKEN, OTHER)


def test_token_mode_without_a_token_refuses_to_start_and_names_no_secret(tmp_path):
    with pytest.raises(ValueError, match=r"\$GAPLESS_TOKENS.*mode: none"):
        load_tokens(AuthConfig(), {})
    with pytest.raises(ValueError, match="cannot be read"):
        load_tokens(AuthConfig(tokens_file=str(tmp_path / "missing")), {})
    with pytest.raises(ValueError, match="shorter than 16") as err:
        load_tokens(AuthConfig(), {"GAPLESS_TOKENS": "short"})
    assert "short" not in str(err.value).replace("shorter", "")
    assert load_tokens(AuthConfig(mode="none"), {}) == ()


def test_config_values_are_checked():
    with pytest.raises(ValueError, match="mode"):
        AuthConfig(mode="basic")
    with pytest.raises(ValueError, match="not an origin"):
        AuthConfig(allowed_origins=["example.com"])
    with pytest.raises(ValueError, match="list"):
        AuthConfig(allowed_origins="https://example.com")
    with pytest.raises(ValueError, match="ticket_ttl_s"):
        AuthConfig(ticket_ttl_s=0)


def test_bearer_header():
    assert bearer({"authorization": f"Bearer {TOKEN}"}) == TOKEN
    assert bearer({"authorization": f"bearer  {TOKEN} "}) == TOKEN
    assert bearer({"authorization": f"Basic {TOKEN}"}) is None
    assert bearer({"authorization": "Bearer "}) is None
    assert bearer({}) is None


def test_handshake_credentials():
    a = auth(tokens=(TOKEN, OTHER))
    a.check({"authorization": f"Bearer {TOKEN}"}, {})
    a.check({"authorization": f"Bearer {OTHER}"}, {})
    with pytest.raises(AuthError, match="required"):
        a.check({}, {})
    with pytest.raises(AuthError, match="not valid"):
        a.check({"authorization": f"Bearer {TOKEN}x"}, {})
    with pytest.raises(AuthError, match="not valid"):
        a.check({"authorization": f"Bearer {TOKEN[:-1]}"}, {})
    open_ = auth(tokens=(), mode="none")
    open_.check({}, {})  # mode none: anyone


# ------------------------------------------------------------------ tickets
def test_a_ticket_opens_one_connection():
    a = auth()
    ticket, ttl = a.issue()
    assert ttl == 60
    assert TOKEN not in ticket
    a.check({}, {"ticket": ticket})
    with pytest.raises(AuthError, match="already used"):
        a.check({}, {"ticket": ticket})
    a.check({}, {"ticket": a.issue()[0]})  # a fresh one is fine


def test_a_ticket_expires():
    clock = Clock()
    a = auth(clock=clock, ticket_ttl_s=60)
    late, soon = a.issue()[0], a.issue()[0]
    clock.t += 59
    a.redeem(soon)
    clock.t += 2
    with pytest.raises(AuthError, match="expired"):
        a.redeem(late)


def test_a_forged_or_foreign_ticket_is_refused():
    a = auth()
    ticket = a.issue()[0]
    issued, expiry, nonce, sig = ticket.split(".")
    other_sig = sig[:-1] + ("1" if sig.endswith("0") else "0")  # always a different signature
    for bad in (f"{issued}.{int(expiry) + 3600_000}.{nonce}.{sig}", f"{int(issued) - 1}.{expiry}.{nonce}.{sig}",
                f"{issued}.{expiry}.{nonce}x.{sig}", f"{issued}.{expiry}.{nonce}.{other_sig}",
                f"{expiry}.{nonce}.{sig}",  # the old three-part form
                "garbage", "", f"{issued}.{expiry}..{sig}", f"{issued}.{expiry}.{nonce}.{sig}.x"):
        with pytest.raises(AuthError, match="not valid"):
            a.redeem(bad)
    with pytest.raises(AuthError, match="not valid"):  # signed with another server's tokens
        a.redeem(auth(tokens=(OTHER,)).issue()[0])


def test_every_replica_with_the_same_tokens_accepts_a_ticket():
    """The key comes from the token set, so another gateway replica verifies it too."""
    issued = auth(tokens=(TOKEN, OTHER)).issue()[0]
    auth(tokens=(OTHER, TOKEN)).redeem(issued)


def test_redeemed_tickets_are_forgotten_once_expired():
    clock = Clock()
    a = auth(clock=clock, ticket_ttl_s=10)
    for _ in range(50):
        a.redeem(a.issue()[0])
    assert len(a.redeemed) == 50
    clock.t += 11
    a.redeem(a.issue()[0])
    assert len(a.redeemed) == 1


# ------------------------------------------------------------------ origins
@pytest.mark.parametrize("origin, host, allowed, ok", [
    (None, "voice.example:8000", (), True),  # not a browser
    ("http://voice.example:8000", "voice.example:8000", (), True),  # the page's own origin
    ("https://VOICE.example:8000/", "voice.example:8000", (), True),
    ("https://evil.example", "voice.example:8000", (), False),
    ("http://voice.example:8001", "voice.example:8000", (), False),  # another port is another origin
    ("null", "voice.example:8000", (), False),  # sandboxed iframes, file:// pages
    ("https://app.example", "voice.example:8000", ("https://app.example",), True),
    ("https://evil.example", "voice.example:8000", ("*",), True),
    ("https://evil.example", None, (), False),
])
def test_origin(origin, host, allowed, ok):
    assert origin_allowed(origin, host, allowed) is ok


# ------------------------------------------------------------------ per-client limits
def test_sessions_per_client_are_capped_per_address():
    limits = ClientLimits(max_sessions_per_client=2, handshakes_per_minute=100)
    limits.open_session("10.0.0.1")
    limits.open_session("10.0.0.1")
    with pytest.raises(LimitExceeded) as exc:
        limits.open_session("10.0.0.1")
    assert exc.value.code == "too_many_sessions"
    limits.open_session("10.0.0.2")  # another client is unaffected
    limits.close_session("10.0.0.1")
    limits.open_session("10.0.0.1")  # a place freed
    assert limits.sessions("10.0.0.1") == 2 and limits.sessions("10.0.0.2") == 1


def test_handshakes_per_minute_slide_per_address():
    clock = Clock(0.0)
    limits = ClientLimits(max_sessions_per_client=1, handshakes_per_minute=3, clock=clock)
    for t in (0.0, 10.0, 20.0):
        clock.t = t
        limits.handshake("a")
    clock.t = 59.0
    with pytest.raises(LimitExceeded, match="try again in 1 s") as exc:
        limits.handshake("a")
    assert exc.value.code == "too_many_handshakes"
    limits.handshake("b")  # another client is unaffected
    clock.t = 60.5  # the first handshake has left the window
    limits.handshake("a")
    with pytest.raises(LimitExceeded):
        limits.handshake("a")


def test_remembered_clients_are_bounded_and_a_new_one_is_never_refused():
    clock = Clock(0.0)
    limits = ClientLimits(max_sessions_per_client=1, handshakes_per_minute=2, max_clients=3, clock=clock)
    limits.handshake("a")
    limits.open_session("a")
    for addr in "bc":
        limits.handshake(addr)
    limits.handshake("b")  # b at its rate, and now the most recently seen
    limits.handshake("d")  # all three within the minute: the least recently seen idle one (c) goes
    assert len(limits) == 3 and limits.sessions("a") == 1
    with pytest.raises(LimitExceeded):
        limits.handshake("b")  # b is still remembered at its rate
    limits.handshake("c")  # c was forgotten: it starts again
    limits.handshake("e")  # forgets b (a holds a session and is passed over)
    limits.handshake("b")
    assert limits.sessions("a") == 1 and len(limits) == 3


# ------------------------------------------------------------------ the gate, in order
def gate(**kw) -> Gatekeeper:
    limits = ClientLimits(kw.pop("per_client", 1), kw.pop("per_minute", 100))
    return Gatekeeper(auth(**kw), limits)


def test_gate_admits_and_releases():
    g = gate()
    hs = Handshake({"authorization": f"Bearer {TOKEN}", "host": "h:1", "origin": "http://h:1"},
                   {"turn_detection": "manual"}, "1.2.3.4")
    admission = g.admit(hs)
    with pytest.raises(Refused) as exc:
        g.admit(hs)
    assert (exc.value.status, exc.value.code) == (429, "too_many_sessions")
    admission.release()
    admission.release()  # idempotent: the count does not go below what is held
    g.admit(hs)
    assert g.limits.sessions("1.2.3.4") == 1


def test_gate_refusals_and_their_statuses():
    g = gate(per_minute=4)
    good = {"authorization": f"Bearer {TOKEN}", "host": "h:1"}
    with pytest.raises(Refused) as exc:
        g.admit(Handshake({**good, "origin": "https://evil.example"}, {}, "a"))
    assert (exc.value.status, exc.value.code) == (403, "origin_not_allowed")
    with pytest.raises(Refused) as exc:
        g.admit(Handshake({"host": "h:1"}, {}, "a"))
    assert (exc.value.status, exc.value.code) == (401, "unauthorized")
    assert g.limits.sessions("a") == 0  # refused handshakes hold nothing
    for _ in range(4):  # refused attempts are not counted against admitted ones
        g.admit(Handshake(good, {}, "a")).release()
    with pytest.raises(Refused) as exc:  # the fifth admitted attempt within the minute
        g.admit(Handshake(good, {}, "a"))
    assert (exc.value.status, exc.value.code) == (429, "too_many_handshakes")
    assert exc.value.body()["type"] == "error"


def test_a_carrier_stream_waits_apart_and_takes_a_session_place_only_once_verified():
    """Anonymous carrier streams cannot hold a token holder's places: they wait in the replica's
    small budget of waiting streams (16, a quarter of it per address; beyond: 503 at once) and hold
    no session place. Each counts as a failed attempt of its address when admitted, forgiven once
    its start is verified: an address past its rate of them is refused at once (429)."""
    g = Gatekeeper(auth(), ClientLimits(1, 6), max_waiting_streams=16)
    anon = [g.admit_stream(Handshake({"host": "h:1"}, {}, "anon")) for _ in range(4)]
    with pytest.raises(Refused) as exc:
        g.admit_stream(Handshake({"host": "h:1"}, {}, "anon"))  # its address's share is taken
    assert (exc.value.status, exc.value.code) == (503, "server_busy")
    others = [g.admit_stream(Handshake({"host": "h:1"}, {}, f"other{i // 4}")) for i in range(12)]
    with pytest.raises(Refused) as exc:
        g.admit_stream(Handshake({"host": "h:1"}, {}, "carrier"))  # all 16 are taken
    assert (exc.value.status, exc.value.code) == (503, "server_busy")
    assert g.limits.sessions("anon") == 0
    g.admit(Handshake({"authorization": f"Bearer {TOKEN}", "host": "h:1"}, {}, "anon"))  # a token holder
    for w in anon + others:  # none showed a good start
        w.release()
    for _ in range(2):
        g.admit_stream(Handshake({"host": "h:1"}, {}, "anon")).release()
    with pytest.raises(Refused) as exc:  # six failed attempts within the minute: anon's rate is spent
        g.admit_stream(Handshake({"host": "h:1"}, {}, "anon"))
    assert (exc.value.status, exc.value.code) == (429, "too_many_handshakes")
    for _ in range(4):
        good = g.admit_stream(Handshake({"host": "h:1"}, {}, "carrier"))
        good.verified()  # its start showed a good credential: now it is a session of its address
        assert g.limits.sessions("carrier") == 1 and len(g.waiting) == 0
        good.release()
        good.release()
    held = g.admit_stream(Handshake({"host": "h:1"}, {}, "carrier"))
    held.verified()
    with pytest.raises(Refused) as exc:
        g.admit_stream(Handshake({"host": "h:1"}, {}, "carrier")).verified()  # past its address's session cap
    assert exc.value.code == "too_many_sessions" and len(g.waiting) == 0
    held.release()
    for _ in range(5):  # the verified ones were forgiven their count: the address's six failures are all left
        g.admit_stream(Handshake({"host": "h:1"}, {}, "carrier")).release()


def test_tickets_and_metrics_need_the_token():
    g = gate()
    with pytest.raises(Refused) as exc:
        g.issue_ticket(Handshake({}, {}, "a"))
    assert exc.value.status == 401
    issued = g.issue_ticket(Handshake({"authorization": f"Bearer {TOKEN}"}, {}, "a"))
    assert issued["url"] == f"/v1/conversation?ticket={issued['ticket']}"
    g.admit(Handshake({}, {"ticket": issued["ticket"], "turn_detection": "vad"}, "a"))
    with pytest.raises(Refused):
        g.check_metrics({})
    g.check_metrics({"authorization": f"Bearer {TOKEN}"})
    gate(metrics_token=False).check_metrics({})
    gate(tokens=(), mode="none").check_metrics({})


def test_the_ticket_is_not_a_session_option():
    hs = Handshake({}, {"ticket": "t", "turn_detection": "manual"}, "a")
    assert hs.session_query == {"turn_detection": "manual"}


# ------------------------------------------------------------------ the shipped configs
def _app_args(config: str) -> dict:
    cfg = yaml.safe_load((ROOT / config).read_text())
    return copy.deepcopy(cfg["applications"][0]["args"]), cfg["http_options"]["host"]


def test_the_gpu_config_does_not_start_open(monkeypatch):
    """serve_config.gpu.yaml listens on 0.0.0.0; without a token `serve run` stops in the app
    builder, before any deployment starts. With one, or with auth: none written, it builds."""
    from deployments.app import AppArgs, configs

    args, host = _app_args("serve_config.gpu.yaml")
    assert host == "0.0.0.0" and args["auth"]["mode"] == "token"
    monkeypatch.delenv("GAPLESS_TOKENS", raising=False)
    with pytest.raises(ValueError, match="no token was found"):
        configs(AppArgs(**args))
    monkeypatch.setenv("GAPLESS_TOKENS", TOKEN)
    assert configs(AppArgs(**args))["auth"]["mode"] == "token"
    monkeypatch.delenv("GAPLESS_TOKENS")
    no_auth_section = {k: v for k, v in args.items() if k != "auth"}
    with pytest.raises(ValueError, match="no token was found"):  # auth unset means auth on
        configs(AppArgs(**no_auth_section))
    configs(AppArgs(**{**args, "auth": {"mode": "none"}}))
    with pytest.raises(ValueError, match="unknown auth settings"):
        configs(AppArgs(**{**args, "auth": {"mode": "token", "tokens": [TOKEN]}}))  # no inline secrets


def test_the_tiny_config_is_open_on_loopback_only(monkeypatch):
    from deployments.app import AppArgs, configs

    args, host = _app_args("serve_config.yaml")
    assert host == "127.0.0.1" and args["auth"] == {"mode": "none"}
    monkeypatch.delenv("GAPLESS_TOKENS", raising=False)
    configs(AppArgs(**args))


# ------------------------------------------------------------------ the door's hardening (issue 25)
def test_an_anonymous_flood_never_costs_a_token_holder():
    """10 000 handshakes without credentials from distinct addresses, each refused 401: a token
    holder, from a new address or from one of theirs, is still admitted (failed attempts are
    counted apart from admitted handshakes, and a full table forgets, it never refuses)."""
    g = gate(per_client=1, per_minute=5)
    for i in range(10_000):
        with pytest.raises(Refused) as exc:
            g.admit(Handshake({"host": "h:1"}, {}, f"127.{i // 65536}.{i // 256 % 256}.{i % 256}"))
        assert exc.value.status == 401
    good = {"authorization": f"Bearer {TOKEN}", "host": "h:1"}
    g.admit(Handshake(good, {}, "10.9.9.9")).release()
    g.admit(Handshake(good, {}, "127.0.0.7")).release()  # an address that also failed once


def test_failed_attempts_are_rate_limited_per_address():
    g = gate(per_minute=3)
    for _ in range(3):
        with pytest.raises(Refused) as exc:
            g.admit(Handshake({"host": "h:1", "authorization": "Bearer wrong-wrong-wrong-wrong"}, {}, "a"))
        assert exc.value.code == "unauthorized"
    with pytest.raises(Refused) as exc:  # the fourth failure within the minute is not even checked
        g.admit(Handshake({"host": "h:1", "authorization": f"Bearer {TOKEN}"}, {}, "a"))
    assert (exc.value.status, exc.value.code) == (429, "too_many_handshakes")
    g.admit(Handshake({"host": "h:1", "authorization": f"Bearer {TOKEN}"}, {}, "b")).release()


@pytest.mark.parametrize("host, allowed, ok", [
    ("localhost:8000", (), True), ("127.0.0.1:8000", (), True), ("[::1]:8000", (), True), ("127.3.4.5", (), True),
    ("rebound.example:8000", (), False),  # a page whose name now resolves to this server
    ("127.evil.example", (), False), ("http://[", (), False), ("", (), False),
    ("Voice.Example.com:443", ("voice.example.com",), True), ("a.voice.example.com", ("*.voice.example.com",), True),
    ("voice.example.com.evil", ("voice.example.com",), False), ("anything", ("*",), True),
])
def test_host(host, allowed, ok):
    assert host_allowed(host, allowed) is ok


def test_a_rebinding_host_is_refused_even_with_its_own_origin():
    """mode none: a page on rebound.example (resolving to 127.0.0.1) sends Origin and Host of its
    own name, which "own origin" alone would let in."""
    g = gate(tokens=(), mode="none", allowed_hosts=())
    with pytest.raises(Refused) as exc:
        g.admit(Handshake({"host": "rebound.example:8000", "origin": "http://rebound.example:8000"}, {}, "a"))
    assert (exc.value.status, exc.value.code) == (403, "host_not_allowed")
    g.admit(Handshake({"host": "127.0.0.1:8000", "origin": "http://127.0.0.1:8000"}, {}, "a")).release()


@pytest.mark.parametrize("origin", ["http://[", "http://h:99999", "http://h:port"])
def test_a_malformed_origin_is_refused_with_403(origin):
    assert origin_allowed(origin, "h:1", ()) is False
    with pytest.raises(Refused) as exc:
        gate().admit(Handshake({"host": "h:1", "origin": origin, "authorization": f"Bearer {TOKEN}"}, {}, "a"))
    assert (exc.value.status, exc.value.code) == (403, "origin_not_allowed")
