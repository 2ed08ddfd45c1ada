# Sourced by the GPU check scripts (load/gpu_check.sh, load/gpu_device.sh, load/gpu_serve.sh): one timed
# step, and the install of what was carried to an air-gapped machine.
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

# install_carried DEST   the site carried to an air-gapped machine (load/gpu_wheels.sh: .gpu_carry/part-*,
#                        one per device call) joined, every checksum checked, and unpacked into DEST (put it
#                        on PYTHONPATH; no pip runs there); a DEST already unpacked from the same parts (a
#                        rerun on a warm machine) is kept. Then what the image lacks for it is listed and
#                        the app's imports are tried. With DRY=1 (a CPU machine of another Python), the same
#                        join and unpacking, without the import check.
install_carried() {
  local dest=$1 rc
  $PY -m load.wheelhouse install "${CARRY:-.gpu_carry}" "$dest"
  rc=$?
  [ $rc = 3 ] && return 0  # kept: checked when it was unpacked
  [ $rc = 0 ] || return 1
  echo "$(ls -d "$dest"/*.dist-info | wc -l) distributions in $dest"
  [ "${DRY:-0}" = 1 ] && return 0
  PYTHONPATH="$dest${PYTHONPATH:+:$PYTHONPATH}" $PY -m load.wheelhouse check "$dest" || true  # listed, not fatal
  PYTHONPATH="$dest:$PWD${PYTHONPATH:+:$PYTHONPATH}" $PY -c "import ray.serve, starlette, uvicorn, msgpack, onnxruntime, \
silero_vad, livekit.rtc, moshi.models.loaders, nemo.collections.asr, llguidance, openai, deployments.app; print('imports ok')"
}
