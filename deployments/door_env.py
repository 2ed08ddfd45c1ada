"""The proxy's limits for every ``serve run`` and ``ray start`` of this environment.

Ray's HTTP proxy applies deployments/proxy_limits.py only when ``RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH``
names it, and reads it from the environment the proxy process inherits: that of ``serve run``'s
driver (which starts a local cluster) or of ``ray start``. For ``serve run CONFIG.yaml`` no code
of ours runs before the cluster starts, so the variable comes from a ``.pth`` file in the
environment's site-packages: Python executes a ``.pth`` line that begins with ``import`` at every
interpreter start. Its line sets the variable unless it is set already (an explicit value, even
an empty one, wins) and imports nothing but ``os``, which ``site`` has imported anyway; it does not
depend on this project being importable at that moment.

scripts/install.sh runs ``python -m deployments.door_env install`` (idempotent) after installing
the project.
"""
from __future__ import annotations

import sys
import sysconfig
from pathlib import Path

from deployments.proxy_limits import CALLBACK, ENV

PTH_NAME = "gapless_door.pth"
PTH_LINE = f"import os; os.environ.setdefault({ENV!r}, {CALLBACK!r})\n"


def install(site_packages: str | Path | None = None) -> Path:
    """Write the ``.pth`` file into ``site_packages`` (default: this interpreter's purelib)
    unless it is there already with this content; returns its path."""
    path = Path(site_packages or sysconfig.get_paths()["purelib"]) / PTH_NAME
    if not path.is_file() or path.read_text() != PTH_LINE:
        path.write_text(PTH_LINE)
    return path


if __name__ == "__main__":
    if sys.argv[1:] != ["install"]:
        sys.exit("usage: python -m deployments.door_env install")
    print(f"{install()}: sets {ENV}={CALLBACK} unless set")
