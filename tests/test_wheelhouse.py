"""The offline wheelhouse for an air-gapped GPU machine (load/wheelhouse.py): what it carries, the
site it installs here and unpacks there, its parts (each within what one device call carries) and
their join, byte for byte, refusing a part that is missing or changed; and the GPU sampling of
load.cost (load/gpu_usage.py)."""
from __future__ import annotations

import base64
import filecmp
import hashlib
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from load import wheelhouse
from load.gpu_usage import GPUUsage, parse

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def payload(tmp_path):
    path = tmp_path / "site.tar.xz"
    path.write_bytes(os.urandom(33000))
    return path


def test_parts_join_back_to_the_same_bytes(payload, tmp_path):
    manifest = wheelhouse.pack(payload, tmp_path / "carry", part_bytes=8192)
    parts = sorted((tmp_path / "carry").glob("part-*/site.tar.xz.*"))
    assert len(parts) == len(manifest["parts"]) >= 4  # 33 kB in 8 kB parts
    assert all(p.stat().st_size <= 8192 for p in parts)
    assert all((p.parent / "MANIFEST.json").exists() for p in parts)  # each call carries its checksums
    joined = wheelhouse.join(tmp_path / "carry", tmp_path / "joined")
    assert filecmp.cmp(payload, joined, shallow=False)


def test_a_missing_or_changed_part_is_refused_by_name(payload, tmp_path):
    wheelhouse.pack(payload, tmp_path / "carry", part_bytes=8192)
    second = tmp_path / "carry" / "part-2" / "site.tar.xz.2"
    data = second.read_bytes()
    second.write_bytes(data[:100] + bytes([data[100] ^ 1]) + data[101:])
    with pytest.raises(wheelhouse.JoinError, match="part-2.*not the part that was packed"):
        wheelhouse.join(tmp_path / "carry", tmp_path / "joined")
    second.unlink()
    with pytest.raises(wheelhouse.JoinError, match="part-2.*missing"):
        wheelhouse.join(tmp_path / "carry", tmp_path / "joined2")
    with pytest.raises(wheelhouse.JoinError, match="nothing was carried"):
        wheelhouse.join(tmp_path / "empty", tmp_path / "joined3")


def _wheel(folder: Path) -> Path:
    """A real (tiny) wheel: a module and a console script, its RECORD hashed as pip checks it."""
    files = {"demo_carried/__init__.py": b"VALUE = 42\ndef main():\n    print('demo', VALUE)\n",
             "demo_carried-1.0.dist-info/METADATA": b"Metadata-Version: 2.1\nName: demo-carried\nVersion: 1.0\n",
             "demo_carried-1.0.dist-info/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
                                                 b"Tag: py3-none-any\n",
             "demo_carried-1.0.dist-info/entry_points.txt": b"[console_scripts]\ndemo-carried = demo_carried:main\n"}
    record = "".join(f"{name},sha256={base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b'=').decode()},"
                     f"{len(data)}\n" for name, data in files.items()) + "demo_carried-1.0.dist-info/RECORD,,\n"
    path = folder / "demo_carried-1.0-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        for name, data in {**files, "demo_carried-1.0.dist-info/RECORD": record.encode()}.items():
            z.writestr(name, data)
    return path


def test_the_site_is_installed_here_unpacked_there_and_kept_on_a_rerun(tmp_path):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    _wheel(wheels)
    archive = tmp_path / "site.tar.xz"
    assert wheelhouse.site_archive(wheels, archive, preset=0) == ["demo_carried-1.0-py3-none-any.whl"]
    wheelhouse.pack(archive, tmp_path / "carry", part_bytes=4096, contents=["demo_carried-1.0-py3-none-any.whl"])
    site = tmp_path / "site"
    there = tmp_path / "python3"  # the other machine's interpreter (here: this one, under another name)
    there.symlink_to(sys.executable)
    assert wheelhouse.install(tmp_path / "carry", site, python=str(there))
    command = site / "bin" / "demo-carried"
    assert command.read_text().splitlines()[0] == f"#!{there}"  # not the #! of the Python that packed it
    ran = subprocess.run([str(command)], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PYTHONPATH": str(site)})
    assert ran.stdout == "demo 42\n", ran.stderr  # its module found on PYTHONPATH
    (site / "demo_carried" / "__init__.py").unlink()
    assert not wheelhouse.install(tmp_path / "carry", site)  # a rerun: the same parts, nothing unpacked
    assert not (site / "demo_carried" / "__init__.py").exists()
    with pytest.raises(wheelhouse.JoinError, match="holds files that no carried site put there"):
        wheelhouse.install(tmp_path / "carry", tmp_path / "wheels")  # never unpacked over other files
    assert (tmp_path / "wheels" / "demo_carried-1.0-py3-none-any.whl").exists()
    first = next((tmp_path / "carry").glob("part-1/site.tar.xz.1"))
    first.write_bytes(first.read_bytes()[:-1])
    with pytest.raises(wheelhouse.JoinError, match="part-1.*not the part that was packed"):
        wheelhouse.install(tmp_path / "carry", tmp_path / "other_site")


def test_a_part_and_the_tree_fit_one_device_call():
    with pytest.raises(ValueError, match="over what one device call carries"):
        wheelhouse.pack(Path("."), Path("."), part_bytes=wheelhouse.DEVICE_CARRY_BYTES + 1)
    tracked = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    tree = sum((ROOT / f).stat().st_size for f in tracked.decode().split("\0") if f and (ROOT / f).is_file())
    clips = 2 * wheelhouse.MIB  # load.speech render: 15 clips, 1.6 MB
    assert wheelhouse.PART_BYTES + tree + clips <= wheelhouse.DEVICE_CARRY_BYTES


def test_the_list_is_the_closure_beyond_the_gpu_image():
    carry, met = wheelhouse.closure(wheelhouse.ROOTS, wheelhouse.image_packages())
    # the served app's own needs and Ray Serve's, pinned to what this .venv runs
    for name in ("ray", "starlette", "uvicorn", "fastapi", "websockets", "silero-vad", "livekit", "llguidance",
                 "moshi", "pipecat-ai", "nemo-toolkit", "lhotse", "openai", "opentelemetry-sdk"):
        assert name in carry, name
    # what the image has is not carried, except where its version is wrong for the app
    for name in ("torch", "numpy", "transformers", "scipy", "aiohttp", "onnxruntime"):
        assert name not in carry and name in met, name
    assert "lightning" in carry and carry["lightning"].startswith("2.4")
    # nothing of the dev extras, nor NeMo's declared but never imported requirements
    for name in ("playwright", "pytest", "wandb", "openai-agents"):
        assert name not in carry, name
    bare, _ = wheelhouse.closure(["gapless"], set())
    assert "torch" in bare and "numpy" in bare  # an image without them would need them carried


def test_unmet_requirements_of_what_was_installed_are_listed(tmp_path):
    info = tmp_path / "demo-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: demo\nVersion: 1.0\n"
                                   "Requires-Dist: numpy>=999\nRequires-Dist: no-such-package-here\n"
                                   "Requires-Dist: packaging\n")
    problems = wheelhouse.unmet(tmp_path)
    assert any("numpy>=999" in p and "is installed" in p for p in problems)
    assert any("no-such-package-here: not installed" in p for p in problems)
    assert not any("packaging" in p for p in problems)


def test_nvidia_smi_lines_and_gpu_seconds():
    assert parse("0, 37, 1024") == (0, 0.37, 1024.0)
    assert parse("index, utilization.gpu [%], memory.used [MiB]") is None
    assert parse("[N/A]") is None
    usage = GPUUsage()
    usage.samples = [(0, 0.4, 1000.0), (0, 0.6, 1200.0), (1, 0.2, 500.0), (1, 0.2, 700.0)]
    s = usage.summary(conversations=4)
    assert s["busy_share"] == {"0": 0.5, "1": 0.2} and s["memory_used_max_mib"] == {"0": 1200.0, "1": 700.0}
    assert s["gpu_s_per_conversation_s"] == pytest.approx(0.7 / 4)
    assert GPUUsage().summary(4) is None  # no nvidia-smi, no samples
