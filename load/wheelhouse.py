"""An offline wheelhouse for an air-gapped GPU machine: what to carry, packed in parts, joined back.

    python -m load.wheelhouse list                      # name==version of every wheel to carry
    python -m load.wheelhouse pack WHEELS_DIR OUT_DIR   # OUT_DIR/part-1/, part-2/, ... each under PART_BYTES
    python -m load.wheelhouse join OUT_DIR DEST_DIR     # checksums checked, the wheels back in DEST_DIR
    python -m load.wheelhouse check SITE_DIR            # requirements of what SITE_DIR holds that nothing meets

``list`` walks the requirement closure of what the served app and its load tools import, pinned
to the versions of this machine's .venv (what CI tests), with the markers of the GPU machine's
Python (3.12, Linux x86-64), and leaves out what the GPU image already has (load/gpu_image.txt).
NeMo is the exception: its declared requirements reach far past what its ASR import needs, so
``nemo_toolkit`` is carried without them and :data:`NEMO_IMPORTS` lists what it imports (found by
importing it on the H200, docs/gpu.md). moshi and pipecat-ai are carried without their pins, as
scripts/install.sh installs them.

``pack`` tars the wheels and splits the tar into parts of at most ``PART_BYTES`` (one device call
carries the repository's tree and one part within 64 MiB); every part directory holds the same
MANIFEST.json (each part's size and sha256, the whole tar's, each wheel's). ``join`` refuses a
missing, short or changed part, a changed tar or a changed wheel, naming it.
"""
from __future__ import annotations

import argparse
import hashlib
import importlib.metadata as md
import json
import sys
import tarfile
from pathlib import Path

from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
IMAGE_LIST = ROOT / "load" / "gpu_image.txt"
MIB = 1 << 20
DEVICE_CARRY_BYTES = 64 * MIB  # what one device call carries: the tree, shared/ and the carried paths
PART_BYTES = 58 * MIB  # leaves 6 MiB of a call for the tree (3 MB today) and the speech clips (1.6 MB)
# The GPU machine's Python, for requirement markers.
TARGET_ENV = {"python_version": "3.12", "python_full_version": "3.12.3", "sys_platform": "linux",
              "platform_system": "Linux", "platform_machine": "x86_64", "os_name": "posix",
              "implementation_name": "cpython", "platform_python_implementation": "CPython"}
# What the app and its load tools import, with their extras: the project's own requirements
# (pyproject.toml) and the load tools' OpenAI SDK (load/realtime_client.py).
ROOTS = ["gapless", "openai", "moshi", "pipecat-ai"]
# Carried without their requirements (scripts/install.sh installs them with --no-deps).
NO_DEPS = {"nemo-toolkit", "moshi", "pipecat-ai"}
# What `import nemo.collections.asr` needs beyond the image (NeMo 3.0.0, measured on the H200),
# lightning 2.4.0 among them: the image's 2.6.6 fails NeMo's logger import.
NEMO_IMPORTS = ["braceexpand", "cytoolz", "datasets", "dill", "hydra-core", "intervaltree", "kaldialign",
                "lhotse", "librosa", "lightning", "multiprocess", "nv-one-logger-core",
                "nv-one-logger-pytorch-lightning-integration", "nv-one-logger-training-telemetry", "omegaconf",
                "antlr4-python3-runtime", "webdataset", "soundfile", "audioread", "pooch", "decorator", "toml",
                "overrides", "strenum", "platformdirs", "cffi", "pycparser", "sacrebleu"]
# Carried though the image has them: the version the app needs differs, or is newer than the
# image is known to hold (Ray's gRPC reflection needs protobuf >= 7.35).
ALWAYS = {"lightning", "protobuf", "grpcio"}
# Requirements of the roots that nothing running on the GPU imports.
NEVER = {"playwright", "py-spy", "pytest", "pytest-timeout", "openai-agents", "vllm", "types-protobuf", "wandb"}


def image_packages(path: Path = IMAGE_LIST) -> set[str]:
    """The GPU image's Python packages (canonical names), from the list kept in the repository."""
    lines = [ln.strip() for ln in path.read_text().splitlines()]
    return {canonicalize_name(ln) for ln in lines if ln and not ln.startswith("#")}


def _requires(dist: md.Distribution, extras: set[str]) -> list[Requirement]:
    out = []
    for text in dist.requires or []:
        req = Requirement(text)
        if req.marker is None or any(req.marker.evaluate({**TARGET_ENV, "extra": e}) for e in extras | {""}):
            out.append(req)
    return out


def closure(roots: list[str], image: set[str]) -> tuple[dict[str, str], dict[str, str]]:
    """(what to carry: name -> version, and why each image package was met), walking the installed
    distributions' requirements from ``roots``; a package the image has is not descended into."""
    carry: dict[str, str] = {}
    met: dict[str, str] = {}
    todo = [Requirement(r) for r in roots] + [Requirement(n) for n in NEMO_IMPORTS]
    seen_extras: dict[str, set[str]] = {}
    while todo:
        req = todo.pop()
        name = canonicalize_name(req.name)
        if name in NEVER:
            continue
        if name in image and name not in ALWAYS:
            met.setdefault(name, str(req))
            continue
        try:
            dist = md.distribution(name)
        except md.PackageNotFoundError:
            raise SystemExit(f"wheelhouse: {name} (needed as {req}) is not installed here; run scripts/install.sh")
        extras = set(req.extras)
        if name in seen_extras and extras <= seen_extras[name]:
            continue
        seen_extras.setdefault(name, set()).update(extras)
        if name != "gapless":  # the project itself travels as the working tree
            carry[name] = dist.version
        if name not in NO_DEPS:
            todo.extend(_requires(dist, seen_extras[name]))
    return carry, met


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(MIB), b""):
            h.update(block)
    return h.hexdigest()


def pack(wheels_dir: Path, out_dir: Path, part_bytes: int = PART_BYTES) -> dict:
    """The wheels of ``wheels_dir`` as one tar split into ``out_dir/part-K/wheels.tar.K`` (K from 1),
    each at most ``part_bytes``, with the manifest in every part directory. Returns the manifest."""
    if part_bytes > DEVICE_CARRY_BYTES:
        raise ValueError(f"a part of {part_bytes} bytes is over what one device call carries ({DEVICE_CARRY_BYTES})")
    wheels = sorted(wheels_dir.glob("*.whl"))
    if not wheels:
        raise SystemExit(f"wheelhouse: no wheels in {wheels_dir}")
    out_dir.mkdir(parents=True, exist_ok=True)
    for old in out_dir.glob("part-*"):
        for f in old.iterdir():
            f.unlink()
        old.rmdir()
    tar_path = out_dir / "wheels.tar"
    with tarfile.open(tar_path, "w", format=tarfile.PAX_FORMAT) as tar:
        for w in wheels:
            info = tar.gettarinfo(str(w), arcname=w.name)
            info.mtime, info.uid, info.gid, info.uname, info.gname = 0, 0, 0, "", ""
            with open(w, "rb") as f:
                tar.addfile(info, f)
    parts = []
    with open(tar_path, "rb") as f:
        k = 1
        while block := f.read(part_bytes):
            d = out_dir / f"part-{k}"
            d.mkdir()
            (d / f"wheels.tar.{k}").write_bytes(block)
            parts.append({"dir": d.name, "file": f"wheels.tar.{k}", "bytes": len(block),
                          "sha256": hashlib.sha256(block).hexdigest()})
            k += 1
    manifest = {"tar_sha256": sha256(tar_path), "tar_bytes": tar_path.stat().st_size, "parts": parts,
                "wheels": {w.name: sha256(w) for w in wheels}}
    tar_path.unlink()
    for p in parts:
        (out_dir / p["dir"] / "MANIFEST.json").write_text(json.dumps(manifest, indent=1))
    return manifest


class JoinError(Exception):
    pass


def join(parts_root: Path, dest: Path) -> list[Path]:
    """The wheels of the parts under ``parts_root``, checked part by part, whole and wheel by wheel,
    extracted into ``dest``. Raises JoinError naming whatever is missing or changed."""
    manifests = sorted(parts_root.glob("part-*/MANIFEST.json"))
    if not manifests:
        raise JoinError(f"no part-*/MANIFEST.json under {parts_root}: nothing was carried")
    manifest = json.loads(manifests[0].read_text())
    for m in manifests[1:]:
        if json.loads(m.read_text()) != manifest:
            raise JoinError(f"{m} differs from {manifests[0]}: the parts come from different packs")
    dest.mkdir(parents=True, exist_ok=True)
    tar_path = dest / "wheels.tar"
    whole = hashlib.sha256()
    with open(tar_path, "wb") as out:
        for p in manifest["parts"]:
            path = parts_root / p["dir"] / p["file"]
            if not path.exists():
                raise JoinError(f"part {path} is missing (carry {p['dir']} in its own device call)")
            block = path.read_bytes()
            if len(block) != p["bytes"] or hashlib.sha256(block).hexdigest() != p["sha256"]:
                raise JoinError(f"part {path} is not the part that was packed ({len(block)} of {p['bytes']} bytes)")
            whole.update(block)
            out.write(block)
    if whole.hexdigest() != manifest["tar_sha256"]:
        raise JoinError("the joined tar's sha256 is not the packed one")
    with tarfile.open(tar_path) as tar:
        tar.extractall(dest, filter="data")
    tar_path.unlink()
    wheels = []
    for name, digest in manifest["wheels"].items():
        w = dest / name
        if not w.exists() or sha256(w) != digest:
            raise JoinError(f"wheel {name} is missing or changed after the join")
        wheels.append(w)
    return wheels


def unmet(site: Path) -> list[str]:
    """Requirements of the distributions installed in ``site`` that no distribution visible to this
    interpreter meets (by name and version), e.g. a carried package needing a newer image package."""
    have = {canonicalize_name(d.metadata["Name"]): d.version for d in md.distributions() if d.metadata["Name"]}
    problems = []
    for dist in md.distributions(path=[str(site)]):
        name = canonicalize_name(dist.metadata["Name"])
        if name in NO_DEPS:
            continue
        for req in _requires(dist, set()):
            got = have.get(canonicalize_name(req.name))
            if got is None:
                problems.append(f"{name} {dist.version} needs {req}: not installed")
            elif req.specifier and not SpecifierSet(str(req.specifier)).contains(Version(got), prereleases=True):
                problems.append(f"{name} {dist.version} needs {req}: {got} is installed")
    return sorted(set(problems))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("list")
    p = sub.add_parser("pack")
    p.add_argument("wheels_dir", type=Path)
    p.add_argument("out_dir", type=Path)
    p.add_argument("--part-mib", type=float, default=PART_BYTES / MIB)
    j = sub.add_parser("join")
    j.add_argument("parts_root", type=Path)
    j.add_argument("dest", type=Path)
    c = sub.add_parser("check")
    c.add_argument("site", type=Path)
    args = ap.parse_args(argv)
    if args.cmd == "list":
        carry, met = closure(ROOTS, image_packages())
        print(f"# {len(carry)} to carry; the GPU image meets {len(met)}: {', '.join(sorted(met))}", file=sys.stderr)
        print("\n".join(f"{n}=={v}" for n, v in sorted(carry.items())))
    elif args.cmd == "pack":
        m = pack(args.wheels_dir, args.out_dir, int(args.part_mib * MIB))
        print(json.dumps({"wheels": len(m["wheels"]), "tar_mib": round(m["tar_bytes"] / MIB, 1),
                          "parts": [{p["dir"]: round(p["bytes"] / MIB, 1)} for p in m["parts"]]}))
    elif args.cmd == "join":
        try:
            wheels = join(args.parts_root, args.dest)
        except JoinError as e:
            print(f"wheelhouse join: {e}", file=sys.stderr)
            return 1
        print(f"{len(wheels)} wheels joined and checked into {args.dest}")
    else:
        problems = unmet(args.site)
        print("\n".join(problems) or "every requirement of the carried packages is met")
        return 1 if problems else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
