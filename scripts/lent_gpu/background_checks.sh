#!/usr/bin/env bash
# Started by first_call.sh. A decode-benchmark smoke run on random weights first (it finds
# GPU-path bugs while the pieces still travel, and tells whether NIXL's UCX runs there), then the
# `cuda` tests that need no model and the attention-kernel benchmark. Logs under /root/res.
cd "$(dirname "$0")/../.." && source scripts/lent_gpu/env.sh
step() { echo "=== $(date +%T) $*"; }
step versions
python3 -c "import sys, torch, triton, pydantic, nixl; print(sys.version.split()[0], 'torch', torch.__version__, \
'triton', triton.__version__, torch.cuda.get_device_name())" 2>&1 | tee $R/versions.txt
step random weights for the 0.5B
timeout 120 python3 scripts/lent_gpu/random_weights.py $D/random_05b_shapes.json \
    ~/.cache/oasiskv/models/qwen2.5-coder-0.5b/model.safetensors
SMOKE="--device cuda --dtype bfloat16 --model qwen2.5-coder-0.5b --contexts 4096 --requests 4 --new-tokens 16
       --repeats 1 --modes dense,lookahead --timing wall --tag smoke_random_weights --out $R/smoke"
step smoke over nixl
if timeout 300 python3 bench/decode_throughput.py $SMOKE --transport nixl > $R/smoke_nixl.log 2>&1; then
    echo nixl > $R/transport
else
    tail -30 $R/smoke_nixl.log; step smoke over tcp
    timeout 300 python3 bench/decode_throughput.py $SMOKE --transport tcp > $R/smoke_tcp.log 2>&1 && echo tcp > $R/transport
fi
tail -8 $R/smoke_*.log
step cuda tests
timeout 400 python3 -m pytest -p no:cacheprovider -m cuda -q -rs tests/decode_node/test_triton_attention.py \
    tests/decode_node/test_block_ranking.py tests/decode_node/test_summary_pages.py > $R/cuda_tests.log 2>&1
tail -5 $R/cuda_tests.log
step attention kernel benchmark
timeout 400 python3 bench/attention_kernel.py --out $R/attention > $R/attention_kernel.log 2>&1
tail -8 $R/attention_kernel.log
step done; touch $R/background.done
