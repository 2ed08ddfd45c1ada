#!/usr/bin/env bash
# The one GPU check: everything a single-GPU machine should measure, unattended. Expected under
# 8 minutes; the step limits below add up to 12 at worst (the dry run on a 2-core CPU: ~6 min).
#
#   bash load/gpu_check.sh            # on a CUDA machine (full-size random-weight models: no checkpoint needed)
#   bash load/gpu_check.sh --dry-run  # the same steps on CPU with tiny shapes: proves the script runs end to end
#
# Steps (each with its own time limit; one that fails or runs out is recorded and the rest go on):
#   stt_b64, stt_b256  load.bench_stt: our batched STT vs NeMo's pipeline, bf16, 64 and 256 streams
#   tts                load.bench_tts_batch: TTS frame step at batch widths 1/8/32 (TTFA, RTF)
#   stall              load.repro_stall: the turn-boundary stall on CUDA, one change per row (the agent's
#                      settings; cudnn.benchmark off; length buckets; both), 3 repeats, a process per row
#   tools              load.bench_tools: a forced tool call on the full-shape LLM, with and without its
#                      llguidance constraint (ms per token, ms to the first argument token)
#   serve              serve_config.gpu.yaml with `profile: full` (random weights at real shapes, auth on
#                      with a throw-away token): a 20-turn gap test, then a load test at N = 8/16/32
# Output: $OUT_DIR (default out/gpu_check): one log per step, and summary.json with each step's exit
# status, seconds and last JSON line. Needs the venv of scripts/install.sh (with a CUDA torch on a GPU).
set -uo pipefail
cd "$(dirname "$0")/.."
DRY=0
[ "${1:-}" = "--dry-run" ] && DRY=1
OUT_DIR=${OUT_DIR:-out/gpu_check}
PY=${PY:-.venv/bin/python}
mkdir -p "$OUT_DIR"
: > "$OUT_DIR/steps.tsv"

STEP_LOGS="$OUT_DIR" STEP_TSV="$OUT_DIR/steps.tsv"
# shellcheck source=load/steps.sh
source load/steps.sh

if [ $DRY = 1 ]; then
  STT="--size tiny --device cpu --dtype float32 --rounds 2"
  STT64="--streams 4 --batch 4"; STT256="--streams 8 --batch 8"
  TTS="--profile tiny --device cpu --widths 1,2 --frames 8 --rounds 1"
  STALL="--mimi tiny --no-gpu --seconds 1.37 --buckets 25 --backend aot_eager --repeats 1"
  TOOLS="--profile tiny --device cpu --rounds 1 --calls 4 --result-turns 1"
  GAP_TURNS=3; LOAD_LEVELS=1,2; LOAD_S=8; BASE_CONFIG=serve_config.yaml; PROFILE=tiny
else
  STT="--size full --device cuda --dtype bfloat16 --rounds 5"
  STT64="--streams 64 --batch 64"; STT256="--streams 256 --batch 256"
  TTS="--profile full --device cuda --widths 1,8,32 --frames 40 --rounds 3"
  STALL="--mimi full --no-cpu --seconds 1.37 2.71 --buckets 25 50 --repeats 3"
  TOOLS="--profile full --device cuda --rounds 3 --calls 8"
  GAP_TURNS=20; LOAD_LEVELS=8,16,32; LOAD_S=20; BASE_CONFIG=serve_config.gpu.yaml; PROFILE=full
fi

# shellcheck disable=SC2086  # the option strings above are meant to split
step stt_b64 90 $PY -m load.bench_stt $STT $STT64
# shellcheck disable=SC2086
step stt_b256 90 $PY -m load.bench_stt $STT $STT256
# shellcheck disable=SC2086
step tts 60 $PY -m load.bench_tts_batch $TTS
# shellcheck disable=SC2086
step stall 200 $PY -m load.repro_stall $STALL
# shellcheck disable=SC2086
step tools 60 $PY -m load.bench_tools $TOOLS

# The app: the chosen config with the chosen profile, auth on, limits wide enough for one load host.
TOKEN=$($PY -c 'import secrets; print(secrets.token_urlsafe(32))')
CONFIG="$OUT_DIR/serve_config.check.yaml"
$PY - "$BASE_CONFIG" "$CONFIG" "$PROFILE" <<'PY'
import sys, yaml
base, out, profile = sys.argv[1:]
cfg = yaml.safe_load(open(base))
args = cfg["applications"][0]["args"]
args["profile"] = profile
args["auth"] = {"mode": "token", "tokens_env": "GAPLESS_TOKENS"}
args["session"].update(max_sessions_per_client=64, handshakes_per_minute=1000)
open(out, "w").write(yaml.safe_dump(cfg, sort_keys=False))
PY
serve_app() {  # start the app, wait for /healthz 200 (at most 150 s), run the gap and load tests, stop it
  GAPLESS_TOKENS=$TOKEN .venv/bin/serve run "$CONFIG" > "$OUT_DIR/serve.log" 2>&1 &
  local pid=$! t0=$SECONDS
  until [ "$(curl -s -o /dev/null -w '%{http_code}' http://127.0.0.1:8000/healthz)" = 200 ]; do
    if [ $((SECONDS - t0)) -gt 150 ] || ! kill -0 $pid 2>/dev/null; then
      echo "the app did not become healthy; see $OUT_DIR/serve.log"; kill $pid 2>/dev/null; return 1
    fi
    sleep 2
  done
  echo "healthy after $((SECONDS - t0)) s"
  local rc=0
  GAPLESS_TOKEN=$TOKEN $PY -m load.gaps --turns $GAP_TURNS --out "$OUT_DIR/gap" || rc=1
  GAPLESS_TOKEN=$TOKEN $PY -m load.concurrency --sessions $LOAD_LEVELS --seconds $LOAD_S --no-progress \
    --out "$OUT_DIR/load" || rc=1
  kill -TERM -- -$pid 2>/dev/null || kill -TERM $pid
  .venv/bin/ray stop --force > /dev/null 2>&1
  return $rc
}
export -f serve_app
export TOKEN CONFIG OUT_DIR PY GAP_TURNS LOAD_LEVELS LOAD_S
step serve 280 setsid bash -c serve_app

$PY -m load.step_summary "$OUT_DIR" "$OUT_DIR/steps.tsv" gpu_check
