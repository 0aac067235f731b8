#!/usr/bin/env bash
# Install OasisKV into ./.venv (created if missing). `--test` adds what the test suite needs.
#
# Order matters: torch first at the pinned version (on a CPU machine pip takes the local CPU
# wheel; anything that asked for an unpinned torch first would pull a multi-GB CUDA build), and
# NIXL with --no-deps (its `nixl` alias would also pull nixl-cu13 and a second torch).
set -euo pipefail
cd "$(dirname "$0")/.."
extras=""
[ "${1:-}" = "--test" ] && extras="[test]"
python=${PYTHON:-python3.11}
command -v "$python" >/dev/null || python=python3
[ -x .venv/bin/python ] || "$python" -m venv .venv
# shellcheck disable=SC1091
. .venv/bin/activate
pip_install() { python -m pip install --quiet --disable-pip-version-check "$@" 2>&1 | grep -v "is ignored" || true; }
pip_install "torch==2.13.0"
pip_install -e ".${extras}"
pip_install --no-deps "nixl-cu12==1.5.1" "nixl==1.5.1"
python - <<'PY'
import importlib
for name in ("torch", "transformers", "gguf", "nixl._api", "ray"):
    importlib.import_module(name)
import torch
print(f"oasiskv environment ready: torch {torch.__version__}, cuda={torch.cuda.is_available()}")
PY
