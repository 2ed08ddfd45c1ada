#!/usr/bin/env bash
# The Python 3.12 wheels that load/gpu_device.sh needs on the borrowed GPU machine and its image
# lacks (it has torch, transformers, numpy, scipy, pydantic-free basics; no internet), into .whl/
# (ignored by git; name it in the device call's `carry`). ~18 MB. Run here, where pip reaches PyPI:
#   bash load/gpu_wheels.sh
# moshi, llguidance (+ jsonschema) for the TTS, stall and tools steps; nemo_toolkit and its import
# closure for the STT step, with lightning 2.4.0 (what NeMo 3.0 runs with here: the image's 2.6.6
# fails NeMo's logger import); pytest for the CUDA-only engine tests (GRAPHS=1). Versions as in .venv;
# all installed there with --no-deps.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
WHEELS="StrEnum==0.4.15 annotated_types==0.8.0 audioread==3.1.0 braceexpand==0.1.7 cffi==2.1.1 cytoolz==1.2.0
datasets==5.2.0 decorator==5.3.1 dill==0.4.1 hydra_core==1.3.2 intervaltree==3.2.1 jsonschema==4.26.0
jsonschema_specifications==2025.9.1 kaldialign==0.12.0 lhotse==1.33.0 librosa==0.11.0 lightning==2.4.0
llguidance==1.9.1 moshi==0.2.13 multiprocess==0.70.19 nemo_toolkit==3.0.0 nv_one_logger_core==2.3.1
nv_one_logger_pytorch_lightning_integration==2.3.1 nv_one_logger_training_telemetry==2.3.1 omegaconf==2.3.0
iniconfig==2.3.1 pluggy==1.7.0 pytest==9.2.0 overrides==7.7.0 platformdirs==4.14.9 pooch==1.9.0 pycparser==3.12 pydantic==2.14.4 pydantic_core==2.50.5
referencing==0.37.0 rpds_py==2026.9.1 soundfile==0.14.0 soxr==1.1.0 toml==0.10.2 typing_extensions==4.16.0
typing_inspection==0.4.5 webdataset==1.0.2"
# shellcheck disable=SC2086
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
  --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d .whl $WHEELS
# antlr4-python3-runtime 4.9.3 (omegaconf's) has no wheel on the index: build its pure-Python one.
ls .whl/antlr4_python3_runtime-4.9.3-*.whl >/dev/null 2>&1 ||
  python3 -m pip wheel -q --no-deps -w .whl antlr4-python3-runtime==4.9.3
du -sh .whl
