"""The ``webrtc:`` section of a serve config (docs/webrtc.md): ICE servers, and where an offer's
candidates may point this server's connectivity checks (:class:`IcePolicy`). Read without
aiortc, so a gateway without the ``webrtc`` extra still starts (and answers no call)."""
from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field

MAX_CANDIDATES = 20  # ICE candidates an offer may carry (browsers send 1-8: host, srflx, relay)


Network = ipaddress.IPv4Network | ipaddress.IPv6Network


@dataclass(frozen=True)
class IcePolicy:
    """Where an offer's candidates may point this server's connectivity checks: public unicast
    addresses, and any address in ``allowed`` (networks the operator allows: a LAN, a VPN,
    loopback for a local test), never one of this host's own (``own``)."""

    max_candidates: int = MAX_CANDIDATES
    allowed: tuple[Network, ...] = ()
    own: frozenset = field(default_factory=frozenset)

    def verdict(self, host: str) -> str | None:
        """None where checks may go to ``host``; else why not (a metrics label)."""
        try:
            ip = ipaddress.ip_address(host)
        except ValueError:
            return "name"  # an mDNS name: resolving it would send a query of the caller's choosing
        if ip in self.own:
            return "own_host"  # even inside an allowed network: the gateway does not probe itself
        if any(ip in net for net in self.allowed):
            return None
        return None if ip.is_global and not ip.is_multicast else "not_public"


def host_addresses() -> frozenset:
    """This host's own addresses (every interface's: what aioice gathers candidates on); none
    where WebRTC is not installed (it then answers no call)."""
    try:
        from aioice.ice import get_host_addresses
    except ImportError:
        return frozenset()
    return frozenset(ipaddress.ip_address(a.split("%")[0]) for a in get_host_addresses(use_ipv4=True, use_ipv6=True))


@dataclass(frozen=True)
class WebRTCConfig:
    ice_servers: list[dict]  # {urls, username, credential} each, as RTCIceServer takes them
    policy: IcePolicy


SECTION_KEYS = ("ice_servers", "max_candidates", "allowed_candidate_networks")


def read_webrtc_section(section: dict | None) -> WebRTCConfig:
    """``webrtc:`` of a serve config: its ICE servers, how many candidates an offer may carry and
    the networks (CIDR) its candidates may point into besides public addresses; an unknown name or
    a bad value raises ValueError."""
    section = dict(section or {})
    unknown = set(section) - set(SECTION_KEYS)
    if unknown:
        raise ValueError(f"unknown webrtc settings {sorted(unknown)}; known: {list(SECTION_KEYS)}")
    servers = [dict(s) for s in section.get("ice_servers") or []]
    for server in servers:
        urls = server.get("urls")
        urls = [urls] if isinstance(urls, str) else urls
        if set(server) - {"urls", "username", "credential"} or not urls or not all(
                isinstance(u, str) and u.startswith(("stun:", "turn:", "turns:")) for u in urls) or not all(
                isinstance(server.get(k, ""), str) for k in ("username", "credential")):
            raise ValueError(f"an ICE server is {{urls: stun:/turn:/turns: URLs, username, credential}}, got {server!r}")
    most = section.get("max_candidates", MAX_CANDIDATES)
    if isinstance(most, bool) or not isinstance(most, int) or not 1 <= most <= 100:
        raise ValueError(f"webrtc max_candidates must be an integer from 1 to 100, got {most!r}")
    try:
        allowed = tuple(ipaddress.ip_network(str(n), strict=False) for n in section.get("allowed_candidate_networks")
                        or [])
    except ValueError as exc:
        raise ValueError(f"webrtc allowed_candidate_networks: {exc} (networks in CIDR form, e.g. 10.0.0.0/8)") from None
    return WebRTCConfig(servers, IcePolicy(most, allowed, host_addresses()))
