#!/usr/bin/env bash
# The offline wheelhouse for an air-gapped GPU machine (Python 3.12, Linux x86-64, CUDA torch of its
# own): every wheel the served app and its load tools need beyond the machine's image, in parts that
# each fit one device call. Run here, where pip reaches the index:
#   bash load/gpu_wheels.sh           # -> .gpu_carry/part-1 ... part-K, and .gpu_carry/speech
# Then carry .gpu_carry/part-1, ..., part-K in device calls made back to back (a warm machine keeps
# what earlier calls carried; two parts today), the last one with .gpu_carry/speech and the run:
# load/gpu_serve.sh joins the parts, checks every checksum and unpacks the site (docs/gpu.md "The plan").
#
# 1. The list (python -m load.wheelhouse list): the requirement closure of what the app and the load
#    tools import, pinned to this .venv's versions, less what the GPU image has (load/gpu_image.txt).
# 2. The wheels, cp312 manylinux, no dependencies resolved again (the list is the closure); antlr4
#    4.9.3 (omegaconf's) has no wheel on the index: its pure-Python wheel is built here.
# 3. The parts (python -m load.wheelhouse pack): the wheels installed here for Python 3.12 into a
#    scratch site, packed as one xz tar (level $XZ_PRESET, 6 unless set; the dry run's 0 packs
#    fast) and split under 57 MiB a part, a manifest of sha256s in each part.
# 4. The spoken test clips (espeak-ng, which the GPU machine lacks): python -m load.speech render.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
CARRY=${CARRY:-.gpu_carry}
WHEELS="$CARRY/wheels"
mkdir -p "$WHEELS"
"$PY" -m load.wheelhouse list > "$CARRY/wheels.txt"
echo "$(wc -l < "$CARRY/wheels.txt") wheels to carry (list: $CARRY/wheels.txt)"
grep -v '^antlr4-python3-runtime==' "$CARRY/wheels.txt" > "$CARRY/binary.txt"
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
  --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d "$WHEELS" -r "$CARRY/binary.txt" 2>&1 | grep -v 'is ignored: it is neither' || true
antlr=$(grep '^antlr4-python3-runtime==' "$CARRY/wheels.txt" || true)
if [ -n "$antlr" ] && ! ls "$WHEELS"/antlr4_python3_runtime-*.whl >/dev/null 2>&1; then
  "$PY" -m pip wheel -q --no-deps -w "$WHEELS" "$antlr" 2>&1 | grep -v 'is ignored: it is neither' || true
fi
# Only the wheels of this list (an older run may have left others).
"$PY" - "$CARRY/wheels.txt" "$WHEELS" <<'PY'
import sys
from pathlib import Path
from packaging.utils import canonicalize_name, parse_wheel_filename
want = {canonicalize_name(l.split("==")[0]): l.split("==")[1] for l in Path(sys.argv[1]).read_text().split()}
got = {}
for w in Path(sys.argv[2]).glob("*.whl"):
    name, version, *_ = parse_wheel_filename(w.name)
    if want.get(name) != str(version):
        w.unlink()
    else:
        got[name] = w
missing = sorted(set(want) - set(got))
if missing:
    sys.exit(f"gpu_wheels: no cp312 wheel downloaded for {missing}")
PY
"$PY" -m load.wheelhouse pack --preset "${XZ_PRESET:-6}" "$WHEELS" "$CARRY"
"$PY" -m load.speech render "$CARRY/speech"
du -sh "$CARRY"/part-* "$CARRY/speech"
