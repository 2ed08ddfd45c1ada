"""Replicas that start warm: torch.compile's work kept on disk and reused by the next process.

A model replica with ``compile=True`` spends minutes in inductor (lowering, code generation,
a C++ compiler per kernel) before it is ready. PyTorch caches that work itself; this module
only gives those caches a home that outlives the process and is shared by the replicas of a node:

- ``TORCHINDUCTOR_CACHE_DIR`` points at ``<root>/<name>-<key>/inductor``. Inductor's FX graph
  cache (``torch._inductor.config.fx_graph_cache``), the AOTAutograd cache
  (``torch._functorch.config.enable_autograd_cache``), both on by default in torch 2.13, and the
  compiled C++ kernels (``.so`` files) live there. Without this, they sit in
  ``/tmp/torchinductor_<user>`` mixed with everything else, and a container restart loses them.
- ``torch.compiler.save_cache_artifacts()`` after warm-up writes the same graphs as one portable
  file, ``<root>/<name>-<key>/artifacts.bin``; ``activate()`` loads it back with
  ``torch.compiler.load_cache_artifacts()`` (this fills an emptied inductor directory, or one on
  another node when only the file was copied). On a CPU the C++ kernels are not in that file:
  a fresh directory loads the graphs but compiles the kernels once again.

What a warm start still pays: dynamo tracing the Python code and checking the cache (seconds);
what it skips: AOTAutograd, inductor lowering and code generation, the C++ compiles (minutes).

Why a stale graph can never load: every entry of inductor's caches is keyed by a hash of its
content (the traced FX graph, input shapes/dtypes/strides, inductor config, torch version,
device and compiler), so a changed model, shape set or source code traces a different graph
and misses. The directory key on top (torch and Python version, machine, engine name and the
engine config's repr) keeps each engine configuration's files apart, makes "hit" mean "this
exact configuration was warmed here before", and lets an operator delete one configuration.

Concurrency: replicas of one node may start at once with the same key. Inductor writes its
entries to a temporary file and renames it; :meth:`CompileCache.save` does the same, so a reader
sees an old complete file or a new complete one, never half of one. Two cold replicas both
compile (neither waits for the other) and the last rename wins; both files are complete.

A cache never stops a replica from starting: a missing, corrupt or unwritable cache logs a
warning and the engine compiles as it would without one.

Root: ``$GAPLESS_COMPILE_CACHE`` or ``/tmp/gapless-compile-cache``; ``GAPLESS_COMPILE_CACHE=off``
turns the cache off (inductor then uses its own default directory). The root must be this user's
alone (``pipeline.runtime.private_dir``): artifacts are unpickled and kernels loaded from it, so a root
another user owns or may write is not used at all (a warning, and the engine compiles).
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import sys
import tempfile
import time
from typing import Any, Callable

from pipeline.runtime.private_dir import NotPrivate, ensure_private_dir

log = logging.getLogger(__name__)

DEFAULT_ROOT = "/tmp/gapless-compile-cache"
ROOT_ENV = "GAPLESS_COMPILE_CACHE"
ARTIFACTS = "artifacts.bin"

# torch._dynamo.utils.counters[group][name] -> our short names
_COUNTERS = {
    "fx_hit": ("inductor", "fxgraph_cache_hit"),
    "fx_miss": ("inductor", "fxgraph_cache_miss"),
    "fx_bypass": ("inductor", "fxgraph_cache_bypass"),
    "aot_hit": ("aot_autograd", "autograd_cache_hit"),
    "aot_miss": ("aot_autograd", "autograd_cache_miss"),
    "aot_bypass": ("aot_autograd", "autograd_cache_bypass"),
}


def cache_root(root: str | None = None) -> str | None:
    """The cache root: ``root``, else ``$GAPLESS_COMPILE_CACHE``, else the default; None when off."""
    root = root if root is not None else os.environ.get(ROOT_ENV, DEFAULT_ROOT)
    return None if root.strip().lower() in ("", "off", "0", "false", "none") else root


def cache_key(name: str, key_material: str) -> str:
    import torch

    parts = {"torch": torch.__version__, "python": sys.version.split()[0], "machine": platform.machine(),
             "name": name, "material": key_material}
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


def _counts() -> dict[str, int]:
    from torch._dynamo.utils import counters

    return {k: int(counters[group][c]) for k, (group, c) in _COUNTERS.items()}


def _write_atomic(path: str, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=f".{os.path.basename(path)}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


class CompileCache:
    """One engine configuration's compile cache: :meth:`activate` before its first compile,
    :meth:`save` after its warm-up. ``loaded`` says whether ``artifacts.bin`` was found and
    loaded; :meth:`counts` what torch's caches did since ``activate``; ``status`` sums it up."""

    def __init__(self, root: str, name: str, key_material: str):
        self.root = os.path.abspath(root)
        self.name = name
        self.key_material = key_material
        self.key = cache_key(name, key_material)
        self.dir = os.path.join(self.root, f"{name}-{self.key[:16]}")
        self.inductor_dir = os.path.join(self.dir, "inductor")
        self.artifacts_path = os.path.join(self.dir, ARTIFACTS)
        self.loaded = False
        self.saved_bytes: int | None = None
        self._before: dict[str, int] | None = None

    def activate(self) -> bool:
        """Point inductor's caches at this configuration's directory and load its saved artifacts.
        Call before anything compiles in this process. Returns whether artifacts were loaded."""
        import torch

        os.makedirs(self.inductor_dir, exist_ok=True)
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = self.inductor_dir  # read on every use by inductor
        self._before = _counts()
        meta = os.path.join(self.dir, "key.json")
        if not os.path.exists(meta):  # what this directory holds, for a person looking at it
            try:
                _write_atomic(meta, json.dumps({"name": self.name, "key": self.key, "torch": torch.__version__,
                                                "python": sys.version.split()[0], "material": self.key_material},
                                               indent=1).encode())
            except OSError as exc:
                log.warning("compile cache %s: cannot write %s: %s", self.name, meta, exc)
        self.loaded = False
        try:
            with open(self.artifacts_path, "rb") as f:
                blob = f.read()
        except FileNotFoundError:
            return False
        except OSError as exc:
            log.warning("compile cache %s: cannot read %s: %s", self.name, self.artifacts_path, exc)
            return False
        try:
            info = torch.compiler.load_cache_artifacts(blob)
        except Exception as exc:  # noqa: BLE001 - a bad cache file must not stop a replica
            log.warning("compile cache %s: cannot load %s: %s", self.name, self.artifacts_path, exc)
            return False
        self.loaded = info is not None
        return self.loaded

    def counts(self) -> dict[str, int]:
        """torch's cache hits / misses / bypasses since :meth:`activate` (in this process)."""
        now = _counts()
        before = self._before or {k: 0 for k in now}
        return {k: now[k] - before[k] for k in now}

    @property
    def status(self) -> str:
        """From torch's own counters since :meth:`activate`: "hit" (every graph came from the
        cache), "partial" (some were compiled), "miss" (all were compiled), "none" (nothing compiled)."""
        c = self.counts()
        hits, misses = c["fx_hit"] + c["aot_hit"], c["fx_miss"] + c["aot_miss"]
        if misses:
            return "partial" if hits else "miss"
        return "hit" if hits else "none"

    def save(self) -> int | None:
        """Write every artifact this process has compiled or loaded so far to ``artifacts.bin``
        (temporary file + rename). Returns its size in bytes, or None if there was nothing to save
        or it could not be written."""
        import torch

        try:
            result = torch.compiler.save_cache_artifacts()
            if result is None:
                return None
            blob, _info = result
            os.makedirs(self.dir, exist_ok=True)
            _write_atomic(self.artifacts_path, blob)
        except Exception as exc:  # noqa: BLE001 - a full disk must not stop a replica
            log.warning("compile cache %s: cannot save %s: %s", self.name, self.artifacts_path, exc)
            return None
        self.saved_bytes = len(blob)
        return self.saved_bytes


def warm_start(name: str, cfg: Any, load: Callable[[], Any], root: str | None = None) -> Callable[[], Any]:
    """``load`` (build + warm-up) wrapped in the compile cache of ``cfg``: activate, load, save.

    Only for configurations with ``compile=True`` (and a cache root that is not "off"); otherwise
    returns ``load`` itself. The wrapper logs hit/miss and seconds and keeps its
    :class:`CompileCache` as ``.cache``. Run the wrapper where ``load`` would run (the replica's
    inference thread), before anything else in the process compiles."""
    root = cache_root(root)
    if root is None or not getattr(cfg, "compile", False):
        return load
    try:
        ensure_private_dir(root)
    except (NotPrivate, OSError) as exc:
        log.warning("%s compile cache not used: %s", name, exc)
        return load
    cache = CompileCache(root, name, repr(cfg))

    def run():
        t0 = time.perf_counter()
        cache.activate()
        engine = load()
        status = cache.status
        if status != "hit" or not cache.loaded:  # after a full hit from the file: the same file again
            cache.save()
        c = cache.counts()
        log.info("%s compile cache %s in %.1f s (%s, artifacts %s; fx graphs %d hit / %d compiled, "
                 "aot %d hit / %d compiled%s)", name, status, time.perf_counter() - t0, cache.dir,
                 "loaded" if cache.loaded else "absent", c["fx_hit"], c["fx_miss"], c["aot_hit"], c["aot_miss"],
                 f"; saved {cache.saved_bytes} bytes" if cache.saved_bytes else "")
        return engine

    run.cache = cache  # type: ignore[attr-defined]
    return run
