#!/usr/bin/env bash
# GPU check of the shared expert inside the grouped GEMMs (about 4 min per tree on one H200):
# the cuda tests of the fold, the one-program alignment and the norm's FP8 rows, then
# `breakgraph bench decode` at batch 16 and 64 and `bench prefill` at 128 and 1024 tokens — the
# sizes where the MoE leaves the decode kernels for the grouped GEMMs. `glm5-tp8-rank` needs more
# than an H100's 80 GB: on a smaller card the 12-layer preset runs instead (PRESET overrides).
# With BASE=<commit> the benches also run at that commit, first, for a same-machine comparison
# (scripts/gpu_bench_trees.sh). Logs under $OUT.
#   OUT=/some/dir [BASE=ec4f17b] [PRESET=glm5-tp8-rank-12l] bash scripts/gpu_check_moe_shared.sh
set -uo pipefail
cd "$(dirname "$0")/.."
export OUT="${OUT:-/tmp/moe-shared-out}" PRESET
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 BREAKGRAPH_CACHE_DIR="${BREAKGRAPH_CACHE_DIR:-$OUT/cache}"
mem=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
PRESET=${PRESET:-$([ "${mem:-0}" -gt 100000 ] && echo glm5-tp8-rank || echo glm5-tp8-rank-12l)}
echo "== $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1), preset $PRESET"
timeout 200 python -m pytest -q -m cuda -p no:cacheprovider tests/test_kernels_moe.py \
  -k "glm5_shapes or dispatch or graph_replay or opcheck or block_folds or norms_fp8" > "$OUT/pytest_moe.log" 2>&1
echo "moe cuda tests: rc=$? $(tail -1 "$OUT/pytest_moe.log")"; grep -a '^FAILED' "$OUT/pytest_moe.log"
bash scripts/gpu_bench_trees.sh  # BASE, PRESET and OUT pass through
echo "elapsed ${SECONDS}s"
