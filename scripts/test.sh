#!/usr/bin/env bash
# Install (with test extras) and run the default test suite. Extra arguments go to pytest,
# e.g. `bash scripts/test.sh -m slow` for the slow suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh --test
bash scripts/install-deploy-tools.sh  # helm, promtool, prometheus, compose: the deploy checks need them
exec .venv/bin/python -m pytest "$@"
