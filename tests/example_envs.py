"""One virtual environment per client example (examples/requirements/NAME.txt, pinned), made once
and kept: under $GAPLESS_EXAMPLE_ENVS (default ~/.cache/gapless/example-envs), named by the
requirements' hash, so a changed pin makes a new one and an unchanged one is reused. Each
client lives apart from the server's environment (pipecat-ai pins protobuf<7, which breaks Ray).
uv makes them when it is there (seconds); else the standard library's venv and pip."""
from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
REQUIREMENTS = ROOT / "examples" / "requirements"


def env_python(name: str) -> Path:
    """The interpreter of example ``name``'s environment, made if it is not there yet."""
    requirements = REQUIREMENTS / f"{name}.txt"
    digest = hashlib.sha256(requirements.read_bytes() + sys.version.encode()).hexdigest()[:12]
    home = Path(os.environ.get("GAPLESS_EXAMPLE_ENVS", Path.home() / ".cache" / "gapless" / "example-envs"))
    env = home / f"{name}-{digest}"
    python = env / "bin" / "python"
    if (env / "ready").exists():
        return python
    shutil.rmtree(env, ignore_errors=True)
    env.parent.mkdir(parents=True, exist_ok=True)
    uv = shutil.which("uv") or shutil.which("uv", path=str(Path(sys.executable).parent))
    if uv:
        subprocess.run([uv, "venv", "-q", "--python", sys.executable, str(env)], check=True)
        subprocess.run([uv, "pip", "install", "-q", "--python", str(python), "-r", str(requirements)], check=True)
    else:
        subprocess.run([sys.executable, "-m", "venv", str(env)], check=True)
        subprocess.run([str(python), "-m", "pip", "install", "-q", "-r", str(requirements)], check=True)
    (env / "ready").write_text(requirements.read_text())
    return python
