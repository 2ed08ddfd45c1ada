#!/usr/bin/env bash
# Install gapless and everything it needs into ./.venv (fresh machine: Python 3.10+, no GPU needed).
#   TORCH_SPEC   torch requirement to install first. Default: torch==2.13.0, the CPU build, from
#                PyTorch's CPU wheel index (PyPI's Linux wheel is a CUDA build of several GB),
#                falling back to the configured indexes where that index cannot be reached. On a
#                GPU machine e.g. TORCH_SPEC="torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128"
#   EXTRAS       pip extras of this project (default "dev"; "dev,gpu" adds vLLM)
#   --system     also install the Debian packages the tests and load tools use (python3-venv,
#                prometheus for the metrics test, espeak-ng for spoken test turns, chromium for the
#                web client's browser test, driven by Playwright with no browser download, openssl
#                for scripts/dev_cert.sh); needs root or sudo
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
has_venv() { "$PY" -c "import ensurepip, venv" >/dev/null 2>&1; }
if [ "${1:-}" = "--system" ]; then
  missing=""
  for pkg in prometheus espeak-ng chromium openssl; do command -v "$pkg" >/dev/null || missing="$missing $pkg"; done
  has_venv || [ -x .venv/bin/python ] || missing="$missing python3-venv"
  if [ -n "$missing" ]; then
    sudo=""; [ "$(id -u)" = 0 ] || sudo="sudo"
    $sudo apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends $missing
  fi
fi
if [ ! -x .venv/bin/python ] && ! has_venv; then
  echo "install.sh: $PY cannot make a virtual environment (no venv/ensurepip): install Debian's" \
       "python3-venv (sudo apt-get install python3-venv), or run: bash scripts/install.sh --system" >&2
  exit 1
fi
[ -x .venv/bin/python ] || "$PY" -m venv .venv
pip=".venv/bin/python -m pip"
$pip install -q --upgrade pip
# torch first, so no later requirement pulls a different (multi-GB CUDA) build.
if [ -n "${TORCH_SPEC:-}" ]; then
  $pip install -q $TORCH_SPEC
elif ! $pip install -q --retries 0 --timeout 15 torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu 2>/dev/null; then
  echo "install.sh: PyTorch's CPU index is out of reach; torch==2.13.0 from the configured indexes" >&2
  $pip install -q torch==2.13.0
fi
.venv/bin/python -c "import torch; b = f'CUDA {torch.version.cuda}' if torch.version.cuda else 'CPU'; print(f'torch {torch.__version__}: the {b} build')"
# Everything else at the versions CI tested (requirements.lock, made on Python 3.11), installed
# without dependency resolution: the one place that works around moshi's and pipecat-ai's pins
# (pyproject.toml says which and why). On another Python, pip resolves pyproject.toml's ranges
# and the two come after, without their dependencies.
if [ -f requirements.lock ] && .venv/bin/python -c "import sys; sys.exit(sys.version_info[:2] != (3, 11))"; then
  $pip install -q --no-deps -r requirements.lock
  $pip install -q --no-deps -e .
  # vLLM is not in the lock (it brings its own torch and pins): resolved here, the install kept editable
  case ",${EXTRAS:-dev}," in *,gpu,*) $pip install -q -e ".[gpu]" ;; esac
else
  $pip install -q -e ".[${EXTRAS:-dev}]"
  $pip install -q --no-deps "moshi==0.2.13" "pipecat-ai==1.14.0" "pyrnnoise==0.4.5"
fi
# Every `serve run` and `ray start` of this venv starts Ray's HTTP proxy with our limits: a .pth
# file sets RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH unless set (deployments/door_env.py).
.venv/bin/python -m deployments.door_env install
.venv/bin/python - <<'PY'
import moshi.models.loaders, torch, numpy, nemo, ray, transformers  # noqa: F401 - import check
from pipeline.conversation.ears.listening import warm_listening
warm_listening()  # Silero VAD and Smart Turn load with their real weights
print(f"installed: torch {torch.__version__}, numpy {numpy.__version__}, ray {ray.__version__}, "
      f"nemo {nemo.__version__}, transformers {transformers.__version__}")
PY
