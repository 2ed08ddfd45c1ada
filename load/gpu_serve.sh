#!/usr/bin/env bash
# The whole app served on one GPU machine at full size (random weights at the real shapes), as a user
# runs it, and measured with the load tools: one prepared run that fits one device call.
#
#   bash load/gpu_serve.sh             # on the air-gapped GPU machine: its python3 (CUDA torch), no venv
#   bash load/gpu_serve.sh --dry-run   # the same steps on a 2-core CPU with tiny shapes (.venv; CI runs it)
#
# Before the GPU run, here: `bash load/gpu_wheels.sh` (the wheelhouse in two parts, the spoken clips),
# then two device calls back to back: .gpu_carry/part-1 (`true`), then .gpu_carry/part-2 and
# .gpu_carry/speech with `bash load/gpu_serve.sh`; a rerun needs no carry (docs/gpu.md "The plan").
#
# On the GPU, whatever Ray an earlier run left (a killed one holds the port and the GPU) is stopped
# first; the dry run stops nothing of a developer's and refuses to start while port 8000 answers.
# Ray is started with the node's GPUs (the dry run: one, so the config's fractional GPU shares are
# placed as on the GPU), then `serve run` joins it; what this script started, it stops.
# Steps (each with its own limit, cut to what is left of TOTAL_S; one that fails or runs out is
# recorded and the rest go on; a step that has less than 30 s left is skipped). At TOTAL_S + 5 s a
# watchdog stops whatever step is still going; the app is stopped and summary.json and tables.md
# are written by TOTAL_S + FINISH_S (the hard deadline, well inside a device call's 600 s), on any
# exit, a kill included:
#   wheels         (dry run only, when nothing was packed) load/gpu_wheels.sh, at xz's fastest level
#   install        the carried parts joined, checksums checked, the site unpacked (load/steps.sh);
#                  a rerun on the warm machine finds the same parts unpacked and keeps them
#   cold_start     `serve run` of serve_config.gpu.yaml as load.gpu_serve writes it (profile full, auth on
#                  with a throw-away token, loopback), until /healthz answers 200: seconds, GPU memory
#   gaps           load.gaps: one conversation, typed and spoken turns, chunk gaps and time to first audio
#   cost_v1_N      load.cost at N conversations at once (load.concurrency's level, a step per N, so a level
#                  cut off loses only itself) over protocol v1, with CPU-seconds and GPU-seconds
#                  (nvidia-smi's busy share) per conversation-second
#   turn_taking    load.turn_taking: hands-free voice-to-voice and its split (and barge-in unless skipped)
#   cost_realtime_N  the same levels over the OpenAI Realtime endpoint
#   metrics        /metrics after the load: compiles and unseen shapes after warm-up (should be 0), GPU
#                  memory per replica process, the gateways' chunk-gap histogram
#   warm_start     the app stopped and served again: seconds to /healthz 200 with the caches warm
# Output ($OUT, default out/gpu_serve; at most 8 files come back from a device call): summary.json (each
# step's exit status, seconds and last JSON line), facts.tsv, tables.md (the tables for docs/gpu.md),
# logs.tar.gz (every log, serve run's included) and serve_config.served.yaml.
set -uo pipefail
cd "$(dirname "$0")/.."
DRY=0
[ "${1:-}" = "--dry-run" ] && DRY=1
OUT=${OUT:-out/gpu_serve}
if [ $DRY = 1 ]; then
  PY=${PY:-.venv/bin/python}; SITE=$(mktemp -d)
  # a scratch wheelhouse unless one is named: the dry run packs fast (larger parts), never for a lease
  export CARRY=${CARRY:-$(mktemp -d)}
  # each kind of step once, as short as proves it (CI runs this): one level of 2 conversations a protocol
  TOTAL_S=${TOTAL_S:-900}; COLD_S=300; LEVELS=${LEVELS:-2}; LEVEL_S=5; BASELINE_S=2; GAP_TURNS=2
  TURN_ARGS="--clips 1 --rounds 1 --hands-free-only"
  # the second start is the first's own step again, and on a CPU with uncompiled tiny engines it
  # warms nothing: not run unless WARM_START=1 (a minute of CI saved)
  WARM_START=${WARM_START:-0}
  NODE="--num-cpus=8 --num-gpus=1"  # logical CPUs for the config's shares; one GPU to place its GPU shares on
  export XZ_PRESET=0  # the wheelhouse packed fast: the same format, checked and unpacked the same way
else
  PY=${PY:-python3}; SITE=${SITE:-/tmp/site}
  export CARRY=${CARRY:-.gpu_carry}
  TOTAL_S=${TOTAL_S:-190}; COLD_S=150; LEVELS=${LEVELS:-8,64}; LEVEL_S=10; BASELINE_S=3; GAP_TURNS=3
  TURN_ARGS="--rounds 1"
  WARM_START=1
  NODE="--num-gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')"
  export PYTHONPATH=$SITE${PYTHONPATH:+:$PYTHONPATH}  # the carried site (Ray among it); every Ray process inherits it
fi
RAY="$PY -m ray.scripts.scripts" SERVE="$PY -m ray.serve.scripts"  # Ray's commands, whatever their #! says
FINISH_S=${FINISH_S:-40}  # after TOTAL_S: the app stopped, the summary written (the hard deadline)
MAIN_PID=$$
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 RAY_USAGE_STATS_ENABLED=0 RAY_DEDUP_LOGS=0
export RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH=deployments.proxy_limits.configure  # as scripts/serve.sh
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}  # Ray's workers import the app from this tree
[ -d "$CARRY/speech" ] && export GAPLESS_SPEECH_DIR=$PWD/$CARRY/speech  # no espeak-ng on the GPU machine
mkdir -p "$OUT"
find "$OUT" -mindepth 1 -delete  # a fresh run (the folder itself stays: a device call's $OUT is handed to us)
mkdir -p "$OUT/logs"
STEP_LOGS="$OUT/logs" STEP_TSV="$OUT/steps.tsv"
: > "$STEP_TSV"
: > "$OUT/facts.tsv"
# shellcheck source=load/steps.sh
source load/steps.sh
fact() { printf '%s\t%s\n' "$1" "$2" >> "$OUT/facts.tsv"; }
T_END=$((SECONDS + TOTAL_S))
left_s() { echo $((T_END - SECONDS)); }
skipped() {  # skipped NAME WHY: a step not run, recorded (exit 125) with its log saying why
  echo "== $1 skipped: $2"
  echo "skipped: $2" > "$STEP_LOGS/$1.log"
  printf '%s\t%s\t%s\n' "$1" 125 0 >> "$STEP_TSV"
}
CURRENT_STEP=""  # the step going on, recorded by finish() as cut off (124) if the deadline stops it
run_step() {  # run_step NAME OWN_LIMIT_S CMD...: the step within what is left of TOTAL_S
  local name=$1 own=$2 left
  left=$(left_s)
  shift 2
  if [ "$left" -lt 30 ]; then
    skipped "$name" "${left} s left of ${TOTAL_S}"
    return
  fi
  CURRENT_STEP=$name CURRENT_T0=$SECONDS
  step "$name" $((own < left ? own : left)) "$@"
  CURRENT_STEP=""
}
gpu_mem() { command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits | awk '{s += $1} END {print s}'; }

# -- the app's start and stop, and the end of the run -----------------------------------------------------
CONFIG="$OUT/serve_config.served.yaml"
SERVE_PID="" RAY_STARTED=0
stop_ray() {  # Ray and serve run stopped, bounded (ray stop ends every Ray process of this user)
  timeout 15 $RAY stop --force > /dev/null 2>&1
  timeout 15 $PY -m load.gpu_serve down || echo "port 8000 still answers after Ray's stop"
}
start_app() {  # start_app LIMIT_S FACT: Ray with the node's GPUs, serve run joining it in its own process group;
  # FACT gets the seconds to /healthz 200 (Ray's start included)
  local t0=$SECONDS
  # shellcheck disable=SC2086
  RAY_STARTED=1
  timeout 60 $RAY start --head $NODE --disable-usage-stats >> "$OUT/logs/serve.log" 2>&1 || return 1
  # shellcheck disable=SC2086
  setsid $SERVE run --address=auto "$CONFIG" >> "$OUT/logs/serve.log" 2>&1 &
  SERVE_PID=$!
  disown "$SERVE_PID"  # stopped by its process group, not waited for by this shell
  local took
  took=$($PY -m load.gpu_serve wait "$SERVE_PID" "$(($1 - (SECONDS - t0)))") || { tail -n 40 "$OUT/logs/serve.log"; return 1; }
  took=$((SECONDS - t0))
  echo "healthy after $took s"
  fact "$2" "$took"
}
stop_app() {  # what start_app started, stopped; bounded: the hard deadline leaves FINISH_S for this and the summary
  [ -n "$SERVE_PID" ] && kill -TERM -- "-$SERVE_PID" 2>/dev/null
  [ "$RAY_STARTED" = 1 ] && stop_ray
  SERVE_PID="" RAY_STARTED=0
}
start_step() {  # start_step NAME LIMIT_S: start_app as a step, in this shell (its pid is the app's)
  local t0=$SECONDS rc
  echo "== $1 (limit ${2}s): serve run $CONFIG"
  CURRENT_STEP=$1 CURRENT_T0=$SECONDS
  start_app "$2" "${1}_s" > "$OUT/logs/$1.log" 2>&1
  rc=$?
  CURRENT_STEP=""
  printf '%s\t%s\t%s\n' "$1" "$rc" "$((SECONDS - t0))" >> "$STEP_TSV"
  echo "   rc=$rc in $((SECONDS - t0)) s; $(tail -n 1 "$OUT/logs/$1.log")"
  return $rc
}
STATUS=1
FINISHED=0
WATCHDOG=""
finish() {  # the app stopped, summary.json, tables.md and logs.tar.gz written: once, on any exit
  [ $FINISHED = 1 ] && return
  FINISHED=1
  [ -n "$WATCHDOG" ] && kill "$WATCHDOG" 2>/dev/null
  trap '' INT TERM  # nothing interrupts the finish; each of its commands is bounded
  [ -n "$CURRENT_STEP" ] && printf '%s\t%s\t%s\n' "$CURRENT_STEP" 124 "$((SECONDS - CURRENT_T0))" >> "$STEP_TSV"
  stop_app
  timeout 15 $PY -m load.step_summary "$OUT/logs" "$STEP_TSV" gpu_serve > "$OUT/steps.json"
  STATUS=$?
  mv "$OUT/logs/summary.json" "$OUT/summary.json"
  timeout 10 $PY -m load.gpu_serve report "$OUT" > /dev/null
  timeout 10 tar -czf "$OUT/logs.tar.gz" -C "$OUT" logs && rm -rf "$OUT/logs"
  cat "$OUT/steps.json"
}
trap 'finish; exit 124' INT TERM
trap 'finish' EXIT
# The hard deadline: at TOTAL_S + 5 s whatever step is going is stopped (the main shell, then its
# children: bash runs the TERM trap once the step's process is gone), and the trap finishes.
( trap 'kill "$nap" 2>/dev/null; exit 0' TERM  # finish() ends the watchdog: no deadline after the end
  sleep $((TOTAL_S + 5)) &
  nap=$!
  wait "$nap"
  echo "== hard deadline: $((TOTAL_S + 5)) s; stopping the step in progress"
  kill -TERM "$MAIN_PID" 2>/dev/null
  for child in $(pgrep -P "$MAIN_PID"); do [ "$child" != "$BASHPID" ] && kill -TERM "$child" 2>/dev/null; done
) &
WATCHDOG=$!

# -- before anything: the port and the GPU free ---------------------------------------------------------
if [ $DRY = 0 ]; then
  # A rerun on a warm machine: a killed run leaves Ray (from the carried site) holding both.
  pkill -TERM -f "(serve|ray\.serve\.scripts) run .*serve_config" 2>/dev/null
  stop_ray
elif [ -n "$($PY -c 'from load.gpu_serve import healthz; print(healthz() or "")')" ]; then
  # On a developer's machine nothing is stopped for it: port 8000 must be free.
  echo "gpu_serve --dry-run: port 8000 answers (a server is running): stop it first" >&2
  exit 2
fi
fact label "$([ $DRY = 1 ] && echo "dry run (CPU, tiny)" || echo "GPU, profile full") $(date -u +%Y-%m-%dT%H:%MZ)"
fact device "\"$( (nvidia-smi -L 2>/dev/null || echo "no GPU: $(nproc) CPU cores") | paste -sd';')\""

# -- what was carried ---------------------------------------------------------------------------------
if [ $DRY = 1 ] && ! ls "$CARRY"/part-*/MANIFEST.json >/dev/null 2>&1; then
  run_step wheels 300 bash load/gpu_wheels.sh
fi
export PY SITE DRY
run_step install 120 bash -c "source load/steps.sh; install_carried $SITE"
[ $DRY = 1 ] && rm -rf "$SITE"  # a cp312 site: checked and unpacked, not for this Python
fact versions "\"$($PY -c 'import sys, torch, ray; print(f"python {sys.version.split()[0]}, torch {torch.__version__} (CUDA {torch.version.cuda}), ray {ray.__version__}")' 2>&1 | tail -n 1)\""

# -- the app --------------------------------------------------------------------------------------------
$PY -m load.gpu_serve config "$CONFIG" $([ $DRY = 1 ] && echo --dry-run)
TOKEN=$($PY -c 'import secrets; print(secrets.token_urlsafe(32))')
export GAPLESS_TOKENS=$TOKEN GAPLESS_TOKEN=$TOKEN
fact gpu_memory_before_mib "$(gpu_mem || echo null)"
left=$(left_s)
start_step cold_start $((COLD_S < left ? COLD_S : left))
rc=$?
fact gpu_memory_healthy_mib "$(gpu_mem || echo null)"

if [ $rc = 0 ]; then
  # shellcheck disable=SC2086
  run_step gaps 90 $PY -m load.gaps --turns $GAP_TURNS --out "$OUT/logs/gap"
  levels() {  # levels PROTOCOL: a load.cost step per N (the idle baseline before the first)
    local base=$BASELINE_S n
    for n in ${LEVELS//,/ }; do
      run_step "cost_$1_$n" 75 $PY -m load.cost --protocol "$1" --sessions "$n" --seconds $LEVEL_S \
        --baseline $base --no-progress --out "$OUT/logs/cost_$1_$n"
      base=0
    done
  }
  levels v1
  # shellcheck disable=SC2086
  run_step turn_taking 130 $PY -m load.turn_taking $TURN_ARGS --out "$OUT/logs/turn_taking"
  levels realtime
  run_step metrics 20 $PY -m load.gpu_serve metrics "$OUT/logs/metrics.json"
  fact metrics_after_load "$(cat "$OUT/logs/metrics.json" 2>/dev/null || echo null)"
  fact gpu_memory_after_load_mib "$(gpu_mem || echo null)"
  stop_app
  left=$((T_END - SECONDS))
  if [ "$WARM_START" != 1 ]; then
    echo "== warm_start not run: the cold start's step again, warming nothing on a CPU (WARM_START=1 runs it)"
  elif [ $left -ge 60 ]; then
    start_step warm_start "$left"
    stop_app
  else
    skipped warm_start "${left} s left of ${TOTAL_S}"
  fi
else
  stop_app
fi

finish
exit $STATUS
