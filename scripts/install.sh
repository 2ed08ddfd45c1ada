#!/usr/bin/env bash
# Install gapless and everything it needs into ./.venv (fresh machine: Python 3.10+, no GPU needed).
#   TORCH_SPEC   torch requirement to install first (default torch==2.13.0, the CPU build; on a
#                GPU machine e.g. TORCH_SPEC="torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128")
#   EXTRAS       pip extras of this project (default "dev"; "dev,gpu" adds vLLM)
#   --system     also install the Debian packages the tests and load tools use (prometheus for the
#                metrics test, espeak-ng for spoken test turns, chromium for the web client's
#                browser test, driven by Playwright with no browser download); needs root or sudo
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "${1:-}" = "--system" ]; then
  missing=""
  for pkg in prometheus espeak-ng chromium; do command -v "$pkg" >/dev/null || missing="$missing $pkg"; done
  if [ -n "$missing" ]; then
    sudo=""; [ "$(id -u)" = 0 ] || sudo="sudo"
    $sudo apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends $missing
  fi
fi
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
pip=".venv/bin/python -m pip"
$pip install -q --upgrade pip
# torch first, so no later requirement pulls a different (multi-GB CUDA) build.
$pip install -q ${TORCH_SPEC:-torch==2.13.0}
$pip install -q -e ".[${EXTRAS:-dev}]"
# moshi without its declared pins (torch<2.10, numpy<2.3, safetensors<0.8, hub<1.0): its Mimi
# runs on the newer versions installed above, and its runtime needs are our own dependencies.
$pip install -q --no-deps "moshi==0.2.13"
# pipecat-ai for Smart Turn v3.2 (its ONNX model and Whisper feature code), also without its pins:
# it wants protobuf<7, which would break Ray (protobuf 7); what its Smart Turn modules import
# (onnxruntime, loguru, soxr, wait_for2, pydantic, numpy) is in our own dependencies.
$pip install -q --no-deps "pipecat-ai==1.14.0"
.venv/bin/python - <<'PY'
import moshi.models.loaders, torch, numpy, nemo, ray, transformers  # noqa: F401 - import check
from pipeline.listening import warm_listening
warm_listening()  # Silero VAD and Smart Turn load with their real weights
print(f"installed: torch {torch.__version__}, numpy {numpy.__version__}, ray {ray.__version__}, "
      f"nemo {nemo.__version__}, transformers {transformers.__version__}")
PY
