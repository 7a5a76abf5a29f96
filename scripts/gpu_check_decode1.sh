#!/usr/bin/env bash
# GPU check of the decode-row kernels (one H200, ≤ 150 s): the cuda tests of the FP8 GEMV and
# the RMSNorm row kernel, then scripts/bench_fp8_gemv.py — the GEMV and its variants beside
# today's FP8 paths at the glm5-tp8-rank shapes, M = 1…64, weights cycled past L2; the norm at
# 1/16/64 rows beside the previous kernel; the router's and indexer's fp32-output products;
# the start-up timing's choices — until the time is spent. Summary tables last.
#   OUT=/some/dir bash scripts/gpu_check_decode1.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/decode1-out}"
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,memory.used --format=csv > "$OUT/gpu.txt" 2>&1

timeout 60 python -m pytest -q -m cuda -p no:cacheprovider --maxfail=5 tests/test_kernels_fp8_gemv.py \
  tests/test_kernels_norm.py > "$OUT/pytest_cuda.log" 2>&1
echo "pytest -m cuda (gemv, norm): rc=$? ; $(tail -1 "$OUT/pytest_cuda.log")"
grep -E "FAILED|Error|assert" "$OUT/pytest_cuda.log" | head -20

timeout $((148 - SECONDS)) python scripts/bench_fp8_gemv.py --out "$OUT" --deadline-s $((134 - SECONDS)) \
  > "$OUT/sweep.log" 2>&1
echo "sweep: rc=$?"
grep -E "WRONG|failed|deadline" "$OUT/sweep.log" | head -20
sed -n '/^| linear/,$p' "$OUT/sweep.log"
echo "elapsed ${SECONDS}s"
