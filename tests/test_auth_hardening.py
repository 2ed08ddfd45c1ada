"""The review's hardening of pipeline/door/auth.py (issue 25, item 12): tickets capped at the
configured lifetime whatever expiry they carry, a redeemed-ticket store replicas can share,
X-Forwarded-For believed only from configured proxies, guessable tokens refused, a tokens file
others can read warned about. Every test here fails against pipeline/door/auth.py before it."""
from __future__ import annotations

import asyncio
import logging
import os
import secrets
from types import SimpleNamespace

import pytest
from starlette.datastructures import Headers

from pipeline.door import auth as A

TOKEN = "tok-0123456789abcdef-one"  # tests/test_auth.py's
STRONG = secrets.token_urlsafe(32)


class Clock:
    def __init__(self, t: float = 1_000_000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


def auth(clock, **kw) -> A.Authenticator:
    redeemed = kw.pop("redeemed", None)
    extra = {"redeemed": redeemed} if redeemed is not None else {}
    return A.Authenticator(A.AuthConfig(**kw), (TOKEN,), clock=clock, **extra)


# ------------------------------------------------------------------ ticket lifetime
def test_a_ticket_is_refused_once_older_than_the_max_ttl_whatever_expiry_it_carries():
    """Another server (or an old config) with the same tokens mints an hour-long ticket: this one,
    at ticket_ttl_s 60, takes it within 60 s of its issue and never after."""
    clock = Clock()
    long_minter, here = auth(clock, ticket_ttl_s=3600), auth(clock, ticket_ttl_s=60)
    young, old = long_minter.issue()[0], long_minter.issue()[0]
    clock.t += 30
    here.redeem(young)
    clock.t += 31  # 61 s after issue, 3539 s before the expiry it carries
    with pytest.raises(A.AuthError, match="expired"):
        here.redeem(old)


def test_a_mint_cannot_ask_for_more_than_the_max_ttl():
    clock = Clock()
    a = auth(clock, ticket_ttl_s=60)
    long, ttl = a.issue(ttl_s=3600)
    assert ttl == 60
    short, ttl = a.issue(ttl_s=10)
    assert ttl == 10
    clock.t += 11
    with pytest.raises(A.AuthError, match="expired"):
        a.redeem(short)
    a.redeem(long)
    asked_long = a.issue(ttl_s=3600)[0]
    clock.t += 61
    with pytest.raises(A.AuthError, match="expired"):
        a.redeem(asked_long)
    for bad in (0, -5):
        with pytest.raises(ValueError, match="positive"):
            a.issue(ttl_s=bad)


def test_a_ticket_from_the_future_is_refused_beyond_the_clock_skew():
    here = auth(Clock(), ticket_ttl_s=60)
    auth_ahead = auth(Clock(1_000_000.0 + 4))  # TICKET_CLOCK_SKEW_S is 5
    here.redeem(auth_ahead.issue()[0])  # a replica whose clock is a little ahead
    far_ahead = auth(Clock(1_000_000.0 + 600))
    with pytest.raises(A.AuthError, match="not valid"):
        here.redeem(far_ahead.issue()[0])


# ------------------------------------------------------------------ redeemed tickets
def test_replicas_sharing_a_store_accept_a_ticket_once():
    clock = Clock()
    shared = A.LocalRedeemed(clock)
    one, two = auth(clock, redeemed=shared), auth(clock, redeemed=shared)
    ticket = one.issue()[0]
    assert two.verify(ticket) == two.verify(ticket) == (ticket.split(".")[2], clock.t + 60)  # uses nothing
    one.redeem(ticket)
    with pytest.raises(A.AuthError, match="already used"):
        two.redeem(ticket)
    # Without a shared store each replica has its own record: the documented limit.
    auth(clock).redeem(ticket)


def test_a_record_is_kept_until_the_ticket_ends_and_no_longer():
    """The record's end is the ticket's: its expiry, capped at issue + ticket_ttl_s; a store is
    asked with it (a shared store sets it as the key's expiry)."""
    clock = Clock()
    calls = []

    class Store:
        def claim(self, nonce, until):
            calls.append((nonce, until))
            return True

    auth(clock, ticket_ttl_s=60, redeemed=Store()).redeem(auth(clock, ticket_ttl_s=3600).issue()[0])
    auth(clock, ticket_ttl_s=60, redeemed=Store()).redeem(auth(clock, ticket_ttl_s=60).issue(ttl_s=5)[0])
    assert [until for _, until in calls] == [clock.t + 60, clock.t + 5]

    local = A.LocalRedeemed(clock)
    a = auth(clock, ticket_ttl_s=60, redeemed=local)
    long_minter = auth(clock, ticket_ttl_s=3600)
    for _ in range(20):
        a.redeem(long_minter.issue()[0])
    assert len(local) == 20
    clock.t += 61
    a.redeem(a.issue()[0])
    assert len(local) == 1  # the hour-long tickets were forgotten with the 60 s cap


# ------------------------------------------------------------------ tokens
@pytest.mark.parametrize("weak", ["a" * 32, "ab" * 12, "passwordpassword", "0000111122223333"])
def test_guessable_tokens_are_refused_naming_the_entry_not_the_token(weak):
    with pytest.raises(ValueError, match=r"too easy to guess.*\$GAPLESS_TOKENS entry 2\)") as err:
        A.load_tokens(A.AuthConfig(), {"GAPLESS_TOKENS": f"{STRONG},{weak}"})
    assert weak not in str(err.value) and STRONG not in str(err.value)


def test_a_guessable_token_in_a_file_is_named_by_its_line(tmp_path):
    f = tmp_path / "tokens"
    f.write_text(f"# ops\n{STRONG}\n{'x' * 40}\n")
    f.chmod(0o600)
    with pytest.raises(ValueError, match=r"file .*tokens line 3\)"):
        A.load_tokens(A.AuthConfig(tokens_env=None, tokens_file=str(f)), {})


def test_random_and_shipped_tokens_pass():
    tokens = [secrets.token_urlsafe(16) for _ in range(300)] + [secrets.token_hex(16) for _ in range(300)]
    tokens += [TOKEN, "tok-0123456789abcdef-two", "a-token-for-the-gpu-config"]  # the unit tests' tokens
    assert A.load_tokens(A.AuthConfig(), {"GAPLESS_TOKENS": " ".join(tokens)}) == tuple(tokens)
    assert A.token_bits("a" * 64) == 0 and A.token_bits("ab" * 8) == 16


def test_a_tokens_file_others_may_read_is_warned_about(tmp_path, caplog):
    f = tmp_path / "tokens"
    f.write_text(f"{STRONG}\n")
    f.chmod(0o644)
    cfg = A.AuthConfig(tokens_env=None, tokens_file=str(f))
    with caplog.at_level(logging.WARNING, logger="pipeline.door.auth"):
        assert A.load_tokens(cfg, {}) == (STRONG,)
    warned = [r.getMessage() for r in caplog.records if r.name == "pipeline.door.auth"]
    assert len(warned) == 1 and "644" in warned[0] and "chmod 600" in warned[0] and STRONG not in warned[0]
    caplog.clear()
    f.chmod(0o600)
    with caplog.at_level(logging.WARNING, logger="pipeline.door.auth"):
        A.load_tokens(cfg, {})
    assert not [r for r in caplog.records if r.name == "pipeline.door.auth"]


# ------------------------------------------------------------------ client address
def test_trusted_proxies_are_checked_and_none_by_default():
    assert A.AuthConfig().trusted_proxies == ()
    cfg = A.AuthConfig(trusted_proxies=["10.0.0.1/8", " 192.168.1.5 ", "::1"])
    assert cfg.trusted_proxies == ("10.0.0.0/8", "192.168.1.5/32", "::1/128")
    with pytest.raises(ValueError, match="not an address"):
        A.AuthConfig(trusted_proxies=["proxy.example"])
    with pytest.raises(ValueError, match="list"):
        A.AuthConfig(trusted_proxies="10.0.0.1")


def through_ray_proxy(peer: tuple[str, int], xff: list[str] | None, allow: str = "127.0.0.1,::1"):
    """What the gateway gets from Ray Serve's HTTP proxy: the scope after uvicorn's
    ProxyHeadersMiddleware (as Ray runs it: FORWARDED_ALLOW_IPS, default loopback)."""
    from uvicorn.middleware.proxy_headers import ProxyHeadersMiddleware

    seen = {}

    async def app(scope, receive, send):
        seen.update(scope)

    raw = [(b"host", b"h:1")] + [(b"x-forwarded-for", v.encode()) for v in (xff or [])]
    scope = {"type": "websocket", "client": peer, "headers": raw, "scheme": "ws"}
    asyncio.run(ProxyHeadersMiddleware(app, trusted_hosts=allow)(scope, None, None))
    return seen["client"], Headers(raw=seen["headers"])


def addr(peer, xff=None, trusted=(), allow="127.0.0.1,::1"):
    client, headers = through_ray_proxy(peer, xff, allow)
    nets = A.proxy_networks(A.AuthConfig(trusted_proxies=list(trusted)).trusted_proxies)
    return A.client_address(client, headers, nets, upstream_allow=allow)


@pytest.mark.parametrize("xff", [["6.6.6.6"], ["6.6.6.6:4444"], ["key-17"], ["1.1.1.1, 2.2.2.2"], ["a", "b"],
                                 ["127.0.0.1, 6.6.6.6"], ["[2001:db8::1]:80"]])
def test_a_loopback_peer_cannot_choose_its_address_by_default(xff):
    """uvicorn in Ray's proxy rewrote the peer from the header (the finding: any local process,
    or anyone through a local proxy, could pick their own client key); it is undone."""
    client, _ = through_ray_proxy(("127.0.0.1", 50000), xff)
    assert client[0] != "127.0.0.1"  # what the gateway saw before
    assert addr(("127.0.0.1", 50000), xff) == "127.0.0.1"
    assert addr(("::1", 50000), xff) == "127.0.0.1"  # loopback, counted as one host


def test_peers_uvicorn_does_not_trust_are_themselves():
    assert addr(("203.0.113.7", 5000), ["6.6.6.6"]) == "203.0.113.7"
    assert addr(("203.0.113.7", 5000), None) == "203.0.113.7"
    assert addr(("127.0.0.16", 5000), ["6.6.6.6"]) == "127.0.0.16"  # tests/e2e_auth's addresses
    assert addr(("127.0.0.1", 5000), None) == "127.0.0.1"
    # A remote client that writes its own address and port into the header looks rewritten: it is
    # counted with loopback, never as anyone it chose.
    assert addr(("203.0.113.7", 5000), ["203.0.113.7:5000"]) == "127.0.0.1"


def test_a_trusted_local_proxy_names_the_client():
    local = ["127.0.0.1"]
    assert addr(("127.0.0.1", 50000), ["6.6.6.6"], local) == "6.6.6.6"
    assert addr(("::1", 50000), ["6.6.6.6"], local) == "6.6.6.6"  # ::1 is loopback too
    assert addr(("127.0.0.1", 50000), ["spoofed, 6.6.6.6"], local) == "6.6.6.6"  # the proxy appended 6.6.6.6
    assert addr(("127.0.0.1", 50000), ["6.6.6.6:1234"], local) == "6.6.6.6"
    assert addr(("127.0.0.1", 50000), None, local) == "127.0.0.1"


def test_a_trusted_remote_proxy_chain():
    lb = ["10.0.0.5"]
    assert addr(("10.0.0.5", 443), ["9.9.9.9, 10.0.0.7"], lb) == "10.0.0.7"  # 10.0.0.7 is not trusted
    assert addr(("10.0.0.5", 443), ["9.9.9.9, 10.0.0.7"], ["10.0.0.0/24"]) == "9.9.9.9"
    assert addr(("10.0.0.5", 443), ["junk, 10.0.0.7"], ["10.0.0.0/24"]) == "10.0.0.7"  # junk: stop at its hop
    assert addr(("10.0.0.5", 443), ["10.0.0.9, 10.0.0.7"], ["10.0.0.0/24"]) == "10.0.0.9"  # all trusted: left-most
    assert addr(("10.0.0.5", 443), ["2001:db8::7"], lb) == "2001:db8::7"
    assert addr(("10.0.0.6", 443), ["9.9.9.9"], lb) == "10.0.0.6"  # another peer is not the proxy
    assert addr(("8.8.8.8", 443), ["9.9.9.9"], ["10.0.0.0/8"]) == "8.8.8.8"


def test_when_uvicorn_trusts_everyone_the_real_peer_is_unknown():
    assert addr(("8.8.8.8", 443), ["9.9.9.9"], allow="*") == "unknown"


def test_the_gateway_reads_a_starlette_connection():
    a = A.Authenticator(A.AuthConfig(trusted_proxies=["10.0.0.5"]), (TOKEN,))
    ws = SimpleNamespace(client=("10.0.0.5", 443),
                         headers=Headers(raw=[(b"x-forwarded-for", b"1.1.1.1"), (b"x-forwarded-for", b"2.2.2.2")]))
    assert a.address_of(ws) == "2.2.2.2"
    assert a.address_of(SimpleNamespace(client=None, headers=Headers())) == "unknown"
    assert A.client_address(("10.0.0.5", 443), {"x-forwarded-for": "1.1.1.1"}, ()) == "10.0.0.5"


@pytest.mark.parametrize("xff", ["1.1.1.1", "1.1.1.1, 127.0.0.1", "127.0.0.1, ::1", "x, [::1]:5", "1.1.1.1:80",
                                 "[2001:db8::1]:443, 10.0.0.1", "", " , 2.2.2.2"])
@pytest.mark.parametrize("allow", ["127.0.0.1,::1", "10.0.0.0/8", "127.0.0.1, proxy-literal", "*"])
def test_the_fallback_picks_as_uvicorn_does(xff, allow):
    from uvicorn.middleware.proxy_headers import _TrustedHosts

    entries = [e.strip() for e in xff.split(",")]
    assert A._pick_like_uvicorn(entries, allow) == _TrustedHosts(allow).get_trusted_client_address(xff)


def test_the_environment_names_what_the_ray_proxy_trusts(monkeypatch):
    monkeypatch.setenv("FORWARDED_ALLOW_IPS", "10.1.1.1")
    client, headers = through_ray_proxy(("10.1.1.1", 9), ["6.6.6.6"], allow=os.environ["FORWARDED_ALLOW_IPS"])
    assert A.client_address(client, headers, ()) == "10.1.1.1"
