"""Replicas that start warm (pipeline/runtime/compile_cache.py): a second process with the same key
compiles nothing, a different key loads nothing of the first's.

Each run is a fresh Python process (fresh in-memory caches, as a new replica) that compiles one
small function with inductor through :func:`warm_start`; torch's own counters say whether the FX
graph / AOTAutograd caches hit or compiled. About 30 s on one core (two cold C++ compiles).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import types
from pathlib import Path


from pipeline.runtime.compile_cache import ARTIFACTS, CompileCache, cache_root, warm_start

ROOT = Path(__file__).resolve().parents[1]

CHILD = r"""
import dataclasses, json, os, sys
import torch
torch.set_num_threads(1)
from pipeline.runtime.compile_cache import warm_start

@dataclasses.dataclass
class Cfg:
    material: str
    compile: bool = True

def f(x, w):
    return (torch.sin(x) * 2.0 + w).relu() - 0.5 * x

def load():
    g = torch.compile(f, dynamic=False)
    x = torch.linspace(-3, 3, 64).reshape(8, 8)
    with torch.inference_mode():
        return g(x, x.T.contiguous())

run = warm_start("toy", Cfg(sys.argv[2]), load, root=sys.argv[1])
y = run()
c = run.cache
print(json.dumps({"status": c.status, "loaded": c.loaded, "counts": c.counts(), "saved": c.saved_bytes,
                  "dir": c.dir, "inductor_env": os.environ["TORCHINDUCTOR_CACHE_DIR"],
                  "y": y.flatten().tolist()}))
"""


def _run(root: Path, material: str) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    env.pop("TORCHINDUCTOR_CACHE_DIR", None)
    p = subprocess.run([sys.executable, "-c", CHILD, str(root), material], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads([ln for ln in p.stdout.splitlines() if ln.startswith("{")][-1])


def test_second_process_with_the_same_key_compiles_nothing_and_another_key_loads_nothing(tmp_path):
    root = tmp_path / "cache"
    cold = _run(root, "A")
    assert cold["status"] == "miss" and not cold["loaded"]
    assert cold["counts"]["fx_miss"] >= 1 and cold["counts"]["fx_hit"] == 0
    assert cold["saved"] and (Path(cold["dir"]) / ARTIFACTS).stat().st_size == cold["saved"]
    assert cold["inductor_env"] == str(Path(cold["dir"]) / "inductor")  # inductor wrote under our key
    assert any((Path(cold["dir"]) / "inductor" / "fxgraph").rglob("*"))
    assert not [p for p in Path(cold["dir"]).iterdir() if p.name.endswith(".tmp")]  # renamed, none left

    saved_at = (Path(cold["dir"]) / ARTIFACTS).stat().st_mtime_ns
    warm = _run(root, "A")
    assert warm["loaded"] and warm["status"] == "hit"
    assert warm["counts"]["fx_hit"] >= 1 and warm["counts"]["fx_miss"] == 0
    assert warm["counts"]["aot_hit"] >= 1 and warm["counts"]["aot_miss"] == 0
    assert warm["y"] == cold["y"]  # the same kernels: bitwise equal
    assert (Path(warm["dir"]) / ARTIFACTS).stat().st_mtime_ns == saved_at  # a full hit rewrites nothing

    other = _run(root, "B")  # the same graph, another configuration: its own, empty, directory
    assert other["dir"] != cold["dir"]
    assert not other["loaded"] and other["status"] == "miss" and other["counts"]["fx_hit"] == 0
    assert other["y"] == cold["y"]


def test_a_corrupt_artifacts_file_is_a_miss_not_a_failure(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", os.environ.get("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "ind")))
    cache = CompileCache(str(tmp_path), "toy", "A")
    os.makedirs(cache.dir)
    Path(cache.artifacts_path).write_bytes(b"not a torch artifact file")
    assert cache.activate() is False and not cache.loaded
    assert cache.status == "none"  # nothing compiled since activate


def test_only_compiled_configurations_use_the_cache(monkeypatch):
    def load():
        return 1

    assert warm_start("x", types.SimpleNamespace(compile=False), load, root="/tmp/x") is load
    assert warm_start("x", types.SimpleNamespace(compile=True), load, root="off") is load
    assert warm_start("x", types.SimpleNamespace(compile=True), load, root="/tmp/x") is not load
    monkeypatch.setenv("GAPLESS_COMPILE_CACHE", "off")
    assert cache_root() is None
    monkeypatch.delenv("GAPLESS_COMPILE_CACHE")
    assert cache_root() == "/tmp/gapless-compile-cache"


def test_key_changes_with_the_configuration():
    a, b = CompileCache("/r", "tts", "TTSConfig(num_slots=2)"), CompileCache("/r", "tts", "TTSConfig(num_slots=4)")
    assert a.key != b.key and a.dir != b.dir
    assert CompileCache("/r", "stt", "TTSConfig(num_slots=2)").dir != a.dir
    assert CompileCache("/r", "tts", "TTSConfig(num_slots=2)").key == a.key
