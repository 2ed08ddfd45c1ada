import os
import secrets
import subprocess

import pytest
import yaml

from tests.e2e.serve_process import ROOT, ServeProcess
from tests.fake_carrier_api import FakeCarrierAPI

# A per-client cap and handshake rate small enough to reach in a test; each test speaks from its
# own loopback address (127.0.0.N), so one test's handshakes never count against another's.
MAX_SESSIONS_PER_CLIENT = 2
HANDSHAKES_PER_MINUTE = 20
TWILIO_AUTH_TOKEN = "e2e-twilio-auth-token"
TWILIO_ACCOUNT_SID = "AC00000000000000000000000000000e2e"
# A phone agent that ends every call at once (a forced end_call): the tests' hang-ups.
PHONE_AGENTS = {"hangs_up": {"speaks_first": True, "tools": ["end_call"],
                             "tool_choice": {"type": "function", "name": "end_call"}}}


@pytest.fixture(scope="package")
def auth_server():
    """serve_config.yaml as a server reachable from other machines is run: auth on (mode token, a
    fresh random token in $GAPLESS_TOKENS of `serve run`, as a user would run it), HTTPS and WSS
    only, with a certificate from scripts/dev_cert.sh, and small per-client limits; nothing else
    changed. The tests' clients trust that certificate (SSL_CERT_FILE, which Python's ssl, httpx
    and websockets read); the browser is told to accept it."""
    tls = ROOT / "out" / "tls-e2e"
    subprocess.run(["bash", str(ROOT / "scripts" / "dev_cert.sh"), str(tls)], check=True, capture_output=True)
    cfg = yaml.safe_load((ROOT / "serve_config.yaml").read_text())
    cfg["http_options"].update(ssl_certfile=str(tls / "cert.pem"), ssl_keyfile=str(tls / "key.pem"))
    app = cfg["applications"][0]
    app["args"]["auth"] = {"mode": "token", "tokens_env": "GAPLESS_TOKENS"}
    app["args"]["session"].update(max_sessions_per_client=MAX_SESSIONS_PER_CLIENT,
                                  handshakes_per_minute=HANDSHAKES_PER_MINUTE)
    # Phone calls with the carriers' accounts set: their REST APIs are a local fake (call control),
    # and Twilio's webhook checks signatures made with TWILIO_AUTH_TOKEN.
    carrier_api = FakeCarrierAPI().start()
    app["args"]["phone"] = {"twilio": {"api_base_url": carrier_api.url},
                            "telnyx": {"api_base_url": carrier_api.url + "/v2"},
                            "agents": PHONE_AGENTS}
    path = ROOT / "out" / "serve_config.auth.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    token = secrets.token_urlsafe(32)
    proc = ServeProcess(str(path), log_path=str(ROOT / "out" / "serve-auth.log"), env={
        "GAPLESS_TOKENS": token, "TWILIO_AUTH_TOKEN": TWILIO_AUTH_TOKEN, "TWILIO_ACCOUNT_SID": TWILIO_ACCOUNT_SID,
        "TELNYX_API_KEY": "KEY0123"}, scheme="https")
    proc.carrier_api = carrier_api
    proc.start()  # the server's own environment keeps the machine's CA bundle
    saved = os.environ.get("SSL_CERT_FILE")
    os.environ["SSL_CERT_FILE"] = str(tls / "cert.pem")
    try:
        proc.token = token
        yield proc
    finally:
        proc.stop()
        carrier_api.stop()
        if saved is None:
            os.environ.pop("SSL_CERT_FILE", None)
        else:
            os.environ["SSL_CERT_FILE"] = saved
