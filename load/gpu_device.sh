#!/usr/bin/env bash
# The engines at full size (random weights) on the borrowed GPU machine: the Ray-free steps of
# load/gpu_check.sh, sized to end within ~9 minutes (the step limits add up to 540 s).
#
#   bash load/gpu_device.sh            # on the device: its python3 (CUDA torch), no venv, no internet
#   bash load/gpu_device.sh --dry-run  # the same steps on CPU with tiny shapes (.venv/bin/python): ~1.5 min
#   GRAPHS=1 bash load/gpu_device.sh   # only the TTS frame step from CUDA graphs (below), ~6 minutes
#
# On the device, what its python3 lacks travels as the wheelhouse of `bash load/gpu_wheels.sh`
# (.gpu_carry/part-K, one per device call made back to back; ignored by git: name it in `carry`),
# joined, checked and unpacked to /tmp/site: a site installed here with --no-deps (load/steps.sh
# install_carried; moshi's pins on torch/numpy/hub are not its runtime needs, and scripts/install.sh
# installs it the same way).
#
# Steps (each with its own time limit; one that fails or runs out is recorded and the rest go on):
#   tts       load.bench_tts_batch: CSM-1B + Mimi frame step at batch widths 1/8/32 vs one stream at a
#             time. 12 frames and 2 rounds, not 40 and 3: the serial baseline runs all 41 streams one
#             after another, eagerly (~7k aten ops a frame at width 1), which would not fit
#   stall_rN  load.repro_stall: the cuDNN turn-boundary stall, one change per row, a process per row;
#             one repeat per step (each its own JSON line), up to 3 while the stall's budget lasts
#   tools     load.bench_tools: a forced tool call on the full-shape LLM, with and without its constraint
#   stt       load.bench_stt: our batched STT vs NeMo's pipeline, bf16, 64 streams
# Limits: tts 130 s, stall 230, tools 90, stt 90 (540 s), each plus what earlier steps left unused.
# Output: $OUT (default out/gpu_device), at most 8 files (what the device sends back): env.log, one
# log per step, and summary.json with each step's exit status, seconds and last JSON line.
set -uo pipefail
cd "$(dirname "$0")/.."
DRY=0
[ "${1:-}" = "--dry-run" ] && DRY=1
GRAPHS=${GRAPHS:-0}
OUT=${OUT:-out/gpu_device}
if [ $DRY = 1 ]; then PY=${PY:-.venv/bin/python}; else PY=${PY:-python3}; fi
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1  # a step cut off still leaves its log; never reach for the hub
mkdir -p "$OUT"
STEPS=$(mktemp)  # name, rc, seconds per step (into summary.json)
trap 'rm -f "$STEPS"' EXIT
: > "$OUT/env.log"

STEP_LOGS="$OUT" STEP_TSV="$STEPS"
# shellcheck source=load/steps.sh
source load/steps.sh
if [ $DRY = 0 ] && ls "${CARRY:-.gpu_carry}"/part-*/MANIFEST.json >/dev/null 2>&1; then
  t0=$SECONDS  # the carried wheelhouse; PYTHONPATH reaches every step's child processes
  install_carried /tmp/site >> "$OUT/env.log" 2>&1 || { echo "wheel install failed:"; tail -n 20 "$OUT/env.log"; exit 1; }
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
  echo "wheels installed to /tmp/site in $((SECONDS - t0)) s" | tee -a "$OUT/env.log"
fi
{
  nvidia-smi -L 2>&1 || true
  $PY - <<'PY'
import sys, importlib.metadata as md
import torch
print(f"python {sys.version.split()[0]}; torch {torch.__version__}, CUDA {torch.version.cuda}, "
      f"available: {torch.cuda.is_available()}")
names = ["transformers", "numpy", "huggingface_hub", "tokenizers", "moshi", "llguidance", "nemo_toolkit",
         "lightning", "pyarrow", "fsspec", "typing_extensions"]
def ver(n):
    try:
        return md.version(n)
    except md.PackageNotFoundError:
        return "-"
print(", ".join(f"{n} {ver(n)}" for n in names))
PY
} 2>&1 | tee -a "$OUT/env.log"

if [ $DRY = 1 ]; then
  TTS="--profile tiny --device cpu --widths 1,2 --frames 8 --rounds 1"
  STALL="--mimi tiny --no-gpu --seconds 1.37 --buckets 25 --backend aot_eager"; STALL_REPEATS=1
  TOOLS="--profile tiny --device cpu --rounds 1 --calls 4 --result-turns 0"
  STT="--size tiny --device cpu --dtype float32 --rounds 1 --streams 4 --batch 4"
else
  TTS="--profile full --device cuda --widths 1,8,32 --frames 12 --rounds 2"
  STALL="--mimi full --no-cpu --seconds 1.37 2.71 --buckets 25 50 --child-timeout 60"; STALL_REPEATS=3
  TOOLS="--profile full --device cuda --rounds 3 --calls 8"
  STT="--size full --device cuda --dtype bfloat16 --rounds 5 --streams 64 --batch 64"
fi
if [ "$GRAPHS" = 1 ]; then
  # The frame step replayed from CUDA graphs (tts.frame_graphs): the engine's test on CUDA (graphed
  # codes equal to eager ones), the step alone (eager vs graphs, same inputs), the engine with it
  # (batched vs one stream at a time, as the tts step above), then torch.compile's reduce-overhead at
  # one width with whatever time is left (its inductor compile of the full step takes minutes).
  if [ $DRY = 1 ]; then
    ALONE="--profile tiny --device cpu --widths 1,2 --steps 4 --rounds 1"; BATCH="$TTS"; COMPILED="$ALONE"
  else
    ALONE="--profile full --device cuda --widths 1,8,32 --steps 10 --rounds 3"; BATCH="$TTS --frame-graphs"
    COMPILED="--profile full --device cuda --widths 8 --steps 10 --rounds 2 --compiled"
  fi
  t_end=$((SECONDS + ${GRAPHS_S:-480}))
  step graphs_test 90 $PY -m pytest -q -p no:cacheprovider tests/test_tts_batching.py -k graphs
  # shellcheck disable=SC2086
  step tts_step 120 $PY -m load.bench_tts_step $ALONE
  # shellcheck disable=SC2086
  step tts_graphs 150 $PY -m load.bench_tts_batch $BATCH
  left=$((t_end - SECONDS))
  # shellcheck disable=SC2086
  [ $left -ge 60 ] && step tts_compiled "$left" $PY -m load.bench_tts_step $COMPILED
  $PY -m load.step_summary "$OUT" "$STEPS" gpu_graphs
  exit 0
fi
# Time limits: each step's own (env TTS_S, STALL_S, TOOLS_S, STT_S; 540 s together) plus whatever
# the steps before it left unused, so a step that ends early gives its time to the next ones.
T_START=$SECONDS
PLANNED=0  # the own limits of the steps so far
limit() {  # limit OWN_S: OWN_S plus the time earlier steps left (at least 30 s)
  local s=$((PLANNED + $1 - (SECONDS - T_START)))
  echo $((s < 30 ? 30 : s))
}

# shellcheck disable=SC2086  # the option strings above are meant to split
step tts "$(limit "${TTS_S:-130}")" $PY -m load.bench_tts_batch $TTS
PLANNED=$((PLANNED + ${TTS_S:-130}))
# The stall's repeats, each its own process tree and JSON line (a repeat cut off loses only itself);
# another starts only if the time left holds 1.1 times the last one.
stall_end=$((SECONDS + $(limit "${STALL_S:-230}")))
last=0
for r in $(seq 1 $STALL_REPEATS); do
  left=$((stall_end - SECONDS))
  if [ "$r" -gt 1 ] && { [ $left -lt $((last * 11 / 10)) ] || [ $left -lt 20 ]; }; then
    echo "== stall_r$r skipped: ${left} s left, the last repeat took ${last} s"
    break
  fi
  t0=$SECONDS
  # shellcheck disable=SC2086
  step "stall_r$r" "$left" $PY -m load.repro_stall $STALL --repeats 1 --order-seed "$r"
  last=$((SECONDS - t0))
done
PLANNED=$((PLANNED + ${STALL_S:-230}))
# shellcheck disable=SC2086
step tools "$(limit "${TOOLS_S:-90}")" $PY -m load.bench_tools $TOOLS
PLANNED=$((PLANNED + ${TOOLS_S:-90}))
# shellcheck disable=SC2086
step stt "$(limit "${STT_S:-90}")" $PY -m load.bench_stt $STT

$PY -m load.step_summary "$OUT" "$STEPS" gpu_device
