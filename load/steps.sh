# Sourced by the GPU check scripts (load/gpu_check.sh, load/gpu_device.sh): one timed step.
#   step NAME LIMIT_S CMD...  runs CMD with a time limit, logs it to $STEP_LOGS/NAME.log, appends
#                             "NAME<tab>rc<tab>seconds" to $STEP_TSV (load/step_summary.py reads both)
step() {
  local name=$1 limit=$2
  shift 2
  local t0=$SECONDS
  echo "== $name (limit ${limit}s): $*"
  timeout --kill-after=10 "$limit" "$@" > "$STEP_LOGS/$name.log" 2>&1
  local rc=$?
  printf '%s\t%s\t%s\n' "$name" "$rc" "$((SECONDS - t0))" >> "$STEP_TSV"
  echo "   rc=$rc in $((SECONDS - t0)) s; last line: $(tail -n 1 "$STEP_LOGS/$name.log" | cut -c1-200)"
}
