#!/usr/bin/env bash
# Device call 1 (carry .dsite): unpack what travelled, then start the checks that need no
# model weights in the background (setsid outlives the call) while the GGUF pieces arrive.
cd "$(dirname "$0")/../.." && source scripts/lent_gpu/env.sh
rm -rf $D && cp -r .dsite $D
mkdir -p /tmp/site && tar -xJf $D/site.tar.xz -C /tmp/site && echo "wheels unpacked"
mkdir -p ~/.cache/oasiskv/models && tar -xzf $D/hf_small.tgz -C ~/.cache/oasiskv/models
nvidia-smi -L; echo "cpus $(nproc)"; free -g | sed -n 2p
setsid nohup bash scripts/lent_gpu/background_checks.sh > $R/background.log 2>&1 < /dev/null &
sleep 20; cat $R/background.log
