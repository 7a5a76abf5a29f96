#!/usr/bin/env bash
# `breakgraph bench decode` (1024-token contexts, 8192 configured) and `bench prefill` (128 and 1024
# tokens, breakable) at this tree and, with BASE=<commit>, first at that commit (its `breakgraph`
# exported to a temporary folder) — a same-machine comparison. Called by the gpu_check scripts;
# logs and tables under $OUT. `glm5-tp8-rank` needs more than an H100's 80 GB: on a smaller card
# the 12-layer preset runs (PRESET overrides). DECODE_BATCHES: the decode batch sizes (default 16 64).
#   OUT=/some/dir [BASE=<commit> | BASE_TREE=<folder>] [PRESET=...] [DECODE_BATCHES="1 16 64"] bash scripts/gpu_bench_trees.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/bench-trees-out}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 BREAKGRAPH_CACHE_DIR="${BREAKGRAPH_CACHE_DIR:-$OUT/cache}"
mem=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
PRESET=${PRESET:-$([ "${mem:-0}" -gt 100000 ] && echo glm5-tp8-rank || echo glm5-tp8-rank-12l)}
read -r -a batches <<< "${DECODE_BATCHES:-16 64}"
source scripts/trees.sh
for tree in "${TREES[@]}"; do
  enter_tree "$tree"
  echo "preset $PRESET"
  timeout 200 python -m breakgraph.cli bench decode --preset "$PRESET" --input-len 1024 --batch-size "${batches[@]}" \
    --context-length 8192 --steps 20 --rounds 2 --top-kernels 6 --output "$OUT/decode_$tree" > "$OUT/decode_$tree.log" 2>&1
  echo "decode bs ${batches[*]}: rc=$?"; grep -aE '^\| 8192 ' "$OUT/decode_$tree.md" 2>/dev/null || tail -3 "$OUT/decode_$tree.log"
  timeout 200 python -m breakgraph.cli bench prefill --preset "$PRESET" --input-len 128 1024 --backends breakable \
    --repeats 5 --top-kernels 8 > "$OUT/prefill_$tree.log" 2>&1
  echo "prefill 128/1024: rc=$?"; grep -aE '^\| breakable ' "$OUT/prefill_$tree.log" || tail -3 "$OUT/prefill_$tree.log"
done
