#!/usr/bin/env bash
# GPU check of the DSA indexer score kernel on one H200 (≤ 120 s): the indexer's CUDA tests
# (GLM-5 shapes, ragged requests, decode in a long pool, FP8 key cache, graph replay), then the
# score-kernel sweep at 8K and 16K tokens (bf16 keys and the FP8 key cache). Logs go to $OUT
# (default /tmp/gpu_check_indexer); the sweep's summary table is printed last.
#
#     OUT=/tmp/out bash scripts/gpu_check_indexer.sh
set -uo pipefail
OUT=${OUT:-/tmp/gpu_check_indexer}
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv > "$OUT/gpu.txt" 2>&1
timeout 45 python -m pytest -q -m cuda -k "indexer or replay_in_cuda_graph" \
    tests/test_kernels_latent_fp8.py tests/test_kernels_attention.py > "$OUT/pytest.log" 2>&1
echo "pytest rc=$? ($(tail -1 "$OUT/pytest.log"))"
timeout 70 python scripts/bench_kernels_attention.py --only indexer --sweep --budget 55 \
    --layouts "prefill 16k" "prefill 8k" > "$OUT/sweep.log" 2>&1
echo "sweep rc=$?"
grep -E "scores \[bt|selection keeps|best scores" "$OUT/sweep.log"
if grep -q "^indexer scores, one layer" "$OUT/sweep.log"; then
    sed -n '/^indexer scores, one layer/,$p' "$OUT/sweep.log"
else  # cut short: the variants it timed
    grep -E "^ +[0-9.]+ ms +[0-9.]+ TFLOP/s" "$OUT/sweep.log"
fi
