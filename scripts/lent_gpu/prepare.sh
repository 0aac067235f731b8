#!/usr/bin/env bash
# Here, before the first device call: what the lent GPU machine lacks, packed to travel.
#   bash scripts/lent_gpu/prepare.sh [model]     # default qwen2.5-coder-1.5b (pulled here first)
# Writes (git-ignored): .dsite/ (the wheels the image lacks, unpacked into one tar.xz; the model's
# small files; the GGUF's sha256; the 0.5B's tensor names for the random-weight smoke model) and
# .gg/NN, the model's GGUF in pieces that fit one call beside the working tree.
set -euo pipefail
cd "$(dirname "$0")/../.."
MODEL=${1:-qwen2.5-coder-1.5b}
PY=${PYTHON:-.venv/bin/python}
exclude=$(git rev-parse --git-path info/exclude)
mkdir -p "$(dirname "$exclude")"
for p in /.dsite/ /.gg/; do grep -qx "$p" "$exclude" 2>/dev/null || echo "$p" >> "$exclude"; done
rm -rf .dsite .gg && mkdir -p .dsite .gg
work=$(mktemp -d); trap 'rm -rf "$work"' EXIT

# The image has torch, Triton, transformers, tokenizers, safetensors, numpy, tqdm, pytest and
# prometheus-client, but not these (python 3.12 there, CUDA 13: nixl-cu13).
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$work/whl" \
    nixl==1.5.1 nixl-cu13==1.5.1 pydantic==2.14.4 pydantic_core==2.50.5 annotated-types==0.8.0 \
    typing-inspection==0.4.5 typing_extensions==4.16.0 gguf==0.19.0
mkdir -p "$work/site" && for w in "$work"/whl/*.whl; do (cd "$work/site" && unzip -q -o "$w"); done
# nixl-cu13 is 59 MB as a wheel; its expert-parallel extension, examples and UCX perftests are
# not used and take most of it.
rm -rf "$work"/site/nixl_ep_cu13 "$work"/site/nixl_cu13-*.data "$work"/site/nixl_cu13.scripts \
    "$work"/site/nixl_cu13.libs/ucx/libucx_perftest*
tar -cJf .dsite/site.tar.xz -C "$work/site" .

"$PY" -c "from oasiskv.models.pull import pull_model; pull_model('$MODEL')" >/dev/null
models=~/.cache/oasiskv/models
tar -czf .dsite/hf_small.tgz -C "$models" --exclude=model.safetensors "$MODEL" qwen2.5-coder-0.5b
gguf=~/.cache/oasiskv/gguf/$MODEL.gguf
sha256sum "$gguf" | cut -c1-64 > .dsite/gguf.sha256
echo "$MODEL" > .dsite/model
"$PY" - <<'PY'
import json
from safetensors import safe_open
from oasiskv.models.pull import pull_model
with safe_open(str(pull_model("qwen2.5-coder-0.5b") / "model.safetensors"), "pt") as f:
    json.dump({k: f.get_slice(k).get_shape() for k in f.keys()}, open(".dsite/random_05b_shapes.json", "w"))
PY
# A call takes 64 MiB: the tracked tree (about 14 MB) plus one piece.
tree=$(git ls-files -z | xargs -0 stat -c %s 2>/dev/null | awk '{s+=$1} END {print s}')
piece=$(( (64 * 1024 * 1024 - tree - 2 * 1024 * 1024) / 1000000 * 1000000 ))
split -b "$piece" -d -a 2 "$gguf" .gg/
echo "pieces: $(ls .gg | wc -l) of $piece bytes; .dsite $(du -sh .dsite | cut -f1)"
