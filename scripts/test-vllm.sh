#!/usr/bin/env bash
# Install the vllm extra into ./.venv-vllm (VENV overrides) and run the vLLM interop suite:
# vLLM on the CPU prefilling through OasisKVConnector into a real store, OasisKV decoding.
# Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh --test --vllm
venv=${VENV:-.venv-vllm}
exec "$venv/bin/python" -m pytest -m "vllm and not slow" tests/vllm_interop "$@"
