import os
import secrets
import subprocess

import pytest
import yaml

from tests.e2e.serve_process import ROOT, ServeProcess

# A per-client cap and handshake rate small enough to reach in a test; each test speaks from its
# own loopback address (127.0.0.N), so one test's handshakes never count against another's.
MAX_SESSIONS_PER_CLIENT = 2
HANDSHAKES_PER_MINUTE = 20


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
    path = ROOT / "out" / "serve_config.auth.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    token = secrets.token_urlsafe(32)
    proc = ServeProcess(str(path), log_path=str(ROOT / "out" / "serve-auth.log"), env={"GAPLESS_TOKENS": token},
                        scheme="https")
    proc.start()  # the server's own environment keeps the machine's CA bundle
    saved = os.environ.get("SSL_CERT_FILE")
    os.environ["SSL_CERT_FILE"] = str(tls / "cert.pem")
    try:
        proc.token = token
        yield proc
    finally:
        proc.stop()
        if saved is None:
            os.environ.pop("SSL_CERT_FILE", None)
        else:
            os.environ["SSL_CERT_FILE"] = saved
