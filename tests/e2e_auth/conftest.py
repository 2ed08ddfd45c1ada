import secrets

import pytest
import yaml

from tests.e2e.serve_process import ROOT, ServeProcess

# A per-client cap and handshake rate small enough to reach in a test; each test speaks from its
# own loopback address (127.0.0.N), so one test's handshakes never count against another's.
MAX_SESSIONS_PER_CLIENT = 2
HANDSHAKES_PER_MINUTE = 20


@pytest.fixture(scope="package")
def auth_server():
    """serve_config.yaml with auth on (mode token, a fresh random token in $GAPLESS_TOKENS of
    `serve run`, as a user would run it) and small per-client limits; nothing else changed."""
    cfg = yaml.safe_load((ROOT / "serve_config.yaml").read_text())
    app = cfg["applications"][0]
    app["args"]["auth"] = {"mode": "token", "tokens_env": "GAPLESS_TOKENS"}
    app["args"]["session"].update(max_sessions_per_client=MAX_SESSIONS_PER_CLIENT,
                                  handshakes_per_minute=HANDSHAKES_PER_MINUTE)
    path = ROOT / "out" / "serve_config.auth.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    token = secrets.token_urlsafe(32)
    proc = ServeProcess(str(path), log_path=str(ROOT / "out" / "serve-auth.log"), env={"GAPLESS_TOKENS": token})
    proc.start()
    proc.token = token
    yield proc
    proc.stop()
