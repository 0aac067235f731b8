#!/usr/bin/env bash
# Device calls 2..N (carry .gg/NN, one piece each): move the piece out of the tree, which the
# next call replaces, and show how the background checks are doing. About 7 s a call on a warm machine.
cd "$(dirname "$0")/../.." && source scripts/lent_gpu/env.sh
mv .gg/* /root/parts/ 2>/dev/null
echo "pieces: $(ls /root/parts | tr '\n' ' ') bytes $(du -sb /root/parts | cut -f1)"
tail -${1:-4} $R/background.log
