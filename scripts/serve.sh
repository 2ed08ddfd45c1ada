#!/usr/bin/env bash
# `serve run` with the proxy's limits (deployments/proxy_limits.py): Ray's HTTP proxy reads the
# callback from the environment it starts in. A venv made by scripts/install.sh sets it already
# (deployments/door_env.py); this sets it even where that step never ran.
# Usage: bash scripts/serve.sh serve_config.yaml
set -euo pipefail
cd "$(dirname "$0")/.."
export RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH="${RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH:-deployments.proxy_limits.configure}"
exec .venv/bin/serve run "$@"
