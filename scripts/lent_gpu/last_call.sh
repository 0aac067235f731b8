#!/usr/bin/env bash
# The last device call (carry the last piece): assemble and convert the model, the engine's
# `cuda` test on it, the decode benchmark at 32K. Results are tarred into $OUT after every step,
# so a call stopped at its limit still brings back what finished.
#   REPEATS=1 (3 repeats of the 1.5B at 32K took ~270 s), PARTS=0/1 (a short breakdown run),
#   WALL_S / PARTS_S: time limits, SKIP_ENGINE_TEST=1, KERNEL=auto|torch|triton
cd "$(dirname "$0")/../.." && source scripts/lent_gpu/env.sh
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
save() { tar -czf $OUT/res.tgz -C /root res 2>/dev/null; }
step() { echo "=== $(date +%T) $*"; }
mv .gg/* /root/parts/ 2>/dev/null
MODEL=$(cat $D/model); M=~/.cache/oasiskv/models/$MODEL
if [ ! -f $M/model.safetensors ]; then
    step assemble; cat $(ls -d /root/parts/* | sort) > /root/model.gguf || exit 3
    [ "$(sha256sum /root/model.gguf | cut -c1-64)" = "$(cat $D/gguf.sha256)" ] || { echo "GGUF sha256 differs"; ls -l /root/parts; exit 4; }
    step convert; python3 scripts/lent_gpu/convert_weights.py /root/model.gguf $M/model.safetensors || exit 5
fi
for _ in $(seq 60); do [ -f $R/background.done ] && break; sleep 5; done  # the GPU to ourselves
tail -3 $R/background.log
T=$(cat $R/transport 2>/dev/null || echo tcp); echo "store transport: $T"
if [ "${SKIP_ENGINE_TEST:-0}" = 0 ]; then
    step engine cuda test
    OASISKV_CUDA_TEST_MODEL=$MODEL timeout 300 python3 -m pytest -p no:cacheprovider -m cuda -q -rs \
        tests/decode_node/test_triton_engine.py > $R/engine_cuda_test.log 2>&1; tail -3 $R/engine_cuda_test.log; save
fi
B="--device cuda --model $MODEL --dtype bfloat16 --contexts 32512 --modes dense,lookahead --transport $T --out $R/bench"
B="$B --attention-kernel ${KERNEL:-auto}"
step decode benchmark, wall timing
timeout ${WALL_S:-250} python3 bench/decode_throughput.py $B --repeats ${REPEATS:-1} --timing wall \
    --tag cuda_32k${TAG:-} > $R/decode_wall.log 2>&1; grep -v "it/s" $R/decode_wall.log | tail -12; save
if [ "${PARTS:-0}" = 1 ]; then
    step decode benchmark, time breakdown
    timeout ${PARTS_S:-100} python3 bench/decode_throughput.py $B --requests 4 --new-tokens 32 --repeats 1 \
        --timing parts --tag cuda_32k_parts_short${TAG:-} > $R/decode_parts.log 2>&1
    grep -v "it/s" $R/decode_parts.log | tail -22; save
fi
step end
