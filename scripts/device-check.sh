#!/usr/bin/env bash
# The GPU checks, for a session that is lent a CUDA machine (see the README's Benchmarks section).
#
#   bash scripts/device-check.sh            # results and logs under $OUT (default /tmp/oasiskv-device)
#
# It needs only torch, Triton and pytest, which GPU images carry, and runs from the source tree
# (PYTHONPATH), so nothing is installed and no network is needed:
#   1. the `cuda` tests of the Triton sparse-attention kernel against the torch path;
#   2. bench/attention_kernel.py: torch path vs Triton kernel at decode shapes (JSON + PNG).
# The engine-level CUDA test (tests/decode_node/test_triton_engine.py) needs the whole install
# and a model, and the block-ranking `cuda` test needs the package's dependencies; run them with
# `pytest -m cuda tests/decode_node` where both are there.
# Not here: the decode benchmark (bench/decode_throughput.py, Qwen 1.5B at 32K) on a GPU. It runs
# the model on the CPU (it has no --device yet), and the lent machine could not hold it anyway: it
# reaches no model hub and takes at most 64 MiB of files a call, against the 1.5B's 3 GB of
# weights, and its image lacks pydantic and nixl (they would have to travel as wheels).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/oasiskv-device}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
PYTHON=${PYTHON:-python3}
status=0
"$PYTHON" -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, \
'cuda', torch.cuda.is_available() and torch.cuda.get_device_name())" | tee "$OUT/versions.txt"
"$PYTHON" -m pytest -p no:cacheprovider -m cuda -q -rs tests/decode_node/test_triton_attention.py 2>&1 \
    | tee "$OUT/cuda_tests.log" || status=1
"$PYTHON" bench/attention_kernel.py --out "$OUT" 2>&1 | tee "$OUT/attention_kernel.log" || status=1
exit $status
