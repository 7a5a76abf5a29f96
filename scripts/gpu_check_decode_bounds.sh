#!/usr/bin/env bash
# GPU check of the decode graphs per sequence-length bound (one H200, about 3 min per tree):
# `breakgraph bench decode` at batch 1 with 8K and 200K tokens configured, alternated over three
# rounds (within 5% of each other is the long-context target), then batch 1/16/64 at 8K. With
# BASE=<commit> the same commands also run at that commit, first, for a same-machine comparison:
# its tree is exported to a temporary folder and run from there, so that its package is the one
# Python imports (`python -m` puts the current folder first on the path). Logs under $OUT.
#   OUT=/some/dir [BASE=b67562e] bash scripts/gpu_check_decode_bounds.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/decode-bounds-out}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 BREAKGRAPH_CACHE_DIR="${BREAKGRAPH_CACHE_DIR:-$OUT/cache}"
source scripts/trees.sh
for tree in "${TREES[@]}"; do
  enter_tree "$tree"
  timeout 200 python -m breakgraph.cli bench decode --preset glm5-tp8-rank --input-len 1024 --batch-size 1 \
    --context-length 8192 200000 --steps 20 --rounds 3 --top-kernels 3 --output "$OUT/ctx_$tree" > "$OUT/ctx_$tree.log" 2>&1
  echo "context 8K vs 200K: rc=$?"; grep -aE '^\| (8192|200000) ' "$OUT/ctx_$tree.md" 2>/dev/null || tail -3 "$OUT/ctx_$tree.log"
  timeout 150 python -m breakgraph.cli bench decode --preset glm5-tp8-rank --input-len 1024 --batch-size 1 16 64 \
    --context-length 8192 --steps 20 --rounds 2 --output "$OUT/bs_$tree" > "$OUT/bs_$tree.log" 2>&1
  echo "batch 1/16/64: rc=$?"; grep -aE '^\| 8192 ' "$OUT/bs_$tree.md" 2>/dev/null || tail -3 "$OUT/bs_$tree.log"
done
echo "elapsed ${SECONDS}s"
