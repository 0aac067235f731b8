#!/usr/bin/env bash
# The GPU checks, for a session that is lent a CUDA machine (see the README's Benchmarks section).
#
#   bash scripts/device-check.sh            # results and logs under $OUT (default /tmp/oasiskv-device)
#
# Steps 1 and 2 need only torch, Triton and pytest, which GPU images carry, and run from the source tree
# (PYTHONPATH), so nothing is installed and no network is needed:
#   1. the `cuda` tests of the Triton sparse-attention kernel against the torch path;
#   2. bench/attention_kernel.py: torch path vs Triton kernel at decode shapes (JSON + PNG);
#   3. bench/decode_throughput.py --device cuda: dense vs lookahead, Qwen 1.5B bf16 at 32K, timed by
#      the wall only (--timing wall, the tokens/s to quote) and once more with a time breakdown (the
#      GPU check of the decode node), where the package's dependencies (pydantic, nixl) import and
#      the model is already pulled (`oasiskv pull qwen2.5-coder-1.5b`); otherwise it says which is
#      missing and is not counted as a failure. A GPU host with `bash scripts/install.sh` run on
#      it has both. The machine lent to development sessions has neither (no network, 64 MiB of
#      files a call against the 1.5B's 1.1 GB GGUF, no pydantic or nixl): scripts/lent_gpu/ gets
#      them there in pieces and runs these same checks.
# The engine-level CUDA test (tests/decode_node/test_triton_engine.py) needs the whole install
# and a model, and the block-ranking `cuda` test needs the package's dependencies; run them with
# `pytest -m cuda tests/decode_node` where both are there.
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
DECODE_MODEL=${DECODE_MODEL:-qwen2.5-coder-1.5b}
if missing=$("$PYTHON" -c "
import importlib.util, sys
names = [n for n in ('torch', 'pydantic', 'nixl') if importlib.util.find_spec(n) is None]
if 'torch' not in names:
    import torch
    names += [] if torch.cuda.is_available() else ['a CUDA device']
if not names:
    from oasiskv.models.pull import is_pulled
    names = [] if is_pulled('$DECODE_MODEL') else ['the model $DECODE_MODEL (oasiskv pull $DECODE_MODEL)']
print(', '.join(names)); sys.exit(1 if names else 0)"); then
    # The tokens/s to quote come from the wall-only run (the GPU synchronized at the run's edges only);
    # one run with per-part timers gives the time breakdown.
    "$PYTHON" bench/decode_throughput.py --device cuda --model "$DECODE_MODEL" --dtype bfloat16 --contexts 32512 \
        --modes dense,lookahead --repeats 3 --timing wall --tag cuda_32k --out "$OUT" 2>&1 \
        | tee "$OUT/decode_throughput.log" || status=1
    "$PYTHON" bench/decode_throughput.py --device cuda --model "$DECODE_MODEL" --dtype bfloat16 --contexts 32512 \
        --modes dense,lookahead --repeats 1 --timing parts --tag cuda_32k_parts --out "$OUT" 2>&1 \
        | tee "$OUT/decode_throughput_parts.log" || status=1
else
    echo "decode benchmark not run: missing $missing" | tee "$OUT/decode_throughput.log"
fi
exit $status
