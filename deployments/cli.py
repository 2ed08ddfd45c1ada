"""The ``gapless`` command: serve the app, talk to it, check this machine.

    gapless serve [CONFIG]   serve_config.yaml (the tiny profile) unless named; Ray's HTTP proxy
                             with the door's limits (deployments/proxy_limits.py)
    gapless talk ...         a turn from the command line (load/talk.py; --help for its options)
    gapless check            what this machine has: Python, the torch build, CUDA and its devices,
                             which real checkpoints are in the Hugging Face cache, the port
    gapless record ID ...    a session's call record as a timeline (load/record.py; --help)
"""
from __future__ import annotations

import argparse
import asyncio
import os
import platform
import shutil
import socket
import sys
from importlib import resources
from pathlib import Path

from deployments.proxy_limits import CALLBACK, ENV

DEFAULT_PORT = 8000
# What serve_config.gpu.yaml loads (profile real): the repositories its header says to fetch.
CHECKPOINTS = ("nvidia/nemotron-speech-streaming-en-0.6b", "sesame/csm-1b", "kyutai/moshiko-pytorch-bf16",
               "Qwen/Qwen2.5-0.5B-Instruct")


def packaged_config(name: str = "serve_config.yaml") -> Path:
    """A serve config that ships with the package (deployments/configs links to the repository's)."""
    return Path(str(resources.files("deployments") / "configs" / name))


def serve(args) -> int:
    """``serve run CONFIG`` with the proxy's callback set (a venv made by scripts/install.sh sets
    it through a .pth too; an explicit value, even empty, wins)."""
    config = Path(args.config) if args.config else Path("serve_config.yaml")
    if not config.exists() and not args.config:
        config = packaged_config()
    if not config.exists():
        print(f"gapless serve: no config {config}", file=sys.stderr)
        return 2
    binary = shutil.which("serve", path=str(Path(sys.executable).parent)) or shutil.which("serve")
    if binary is None:
        print("gapless serve: Ray Serve's `serve` command is not installed (pip install 'ray[serve]')", file=sys.stderr)
        return 2
    env = dict(os.environ)
    env.setdefault(ENV, CALLBACK)
    os.execve(binary, [binary, "run", str(config)], env)
    return 0  # not reached


def talk(rest: list[str]) -> int:
    """load/talk.py with everything after ``talk`` (its own options and --help)."""
    from load import talk as talk_tool

    return asyncio.run(talk_tool.main(rest, prog="gapless talk"))


def facts(port: int = DEFAULT_PORT) -> dict[str, object]:
    """What this machine has, for ``gapless check``."""
    out: dict[str, object] = {"python": platform.python_version(), "machine": platform.machine()}
    try:
        import torch

        out["torch"] = torch.__version__
        out["torch build"] = f"CUDA {torch.version.cuda}" if torch.version.cuda else "CPU"
        out["cuda devices"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] \
            if torch.cuda.is_available() else []
    except ImportError:
        out["torch"] = None
    try:
        from huggingface_hub import scan_cache_dir

        cached = {repo.repo_id for repo in scan_cache_dir().repos}
    except Exception:  # noqa: BLE001 - no cache yet, or no hub package
        cached = set()
    out["checkpoints in the cache"] = {name: name in cached for name in CHECKPOINTS}
    with socket.socket() as sock:
        out[f"port {port} free"] = sock.connect_ex(("127.0.0.1", port)) != 0
    return out


def check(args) -> int:
    for name, value in facts(args.port).items():
        print(f"{name}: {value}")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="gapless", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)
    p = sub.add_parser("serve", help="serve the app (serve_config.yaml unless a config is named)")
    p.add_argument("config", nargs="?", help="a serve config (default: ./serve_config.yaml, else the packaged one)")
    p.set_defaults(run=serve)
    sub.add_parser("talk", help="a turn from the command line (gapless talk --help)", add_help=False)
    sub.add_parser("record", help="a session's call record as a timeline (gapless record --help)", add_help=False)
    p = sub.add_parser("check", help="what this machine has: Python, torch, CUDA, checkpoints, the port")
    p.add_argument("--port", type=int, default=DEFAULT_PORT)
    p.set_defaults(run=check)
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["talk"]:  # its options are load/talk.py's, passed on as they are
        return talk(argv[1:])
    if argv[:1] == ["record"]:  # load/record.py's
        from load import record

        return record.main(argv[1:], prog="gapless record")
    args = ap.parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
