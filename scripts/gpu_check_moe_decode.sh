#!/usr/bin/env bash
# GPU check of the MoE decode kernels (one H200, ≤ 150 s): their cuda tests, then old vs new MoE
# layer at glm5-tp8-rank decode sizes with the weight floor, a tile sweep, table last.
#   OUT=/some/dir bash scripts/gpu_check_moe_decode.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/moe-decode-out}"
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,memory.used --format=csv > "$OUT/gpu.txt" 2>&1
timeout 50 python -m pytest -q -m cuda tests/test_kernels_moe.py -k "decode" -p no:cacheprovider -s \
  > "$OUT/pytest_cuda.log" 2>&1
echo "pytest -m cuda (decode tests): rc=$? ; $(tail -1 "$OUT/pytest_cuda.log")"
grep -E "rel err|FAILED|Error" "$OUT/pytest_cuda.log" | head -20
timeout 95 python scripts/bench_moe_decode.py --tokens 1 16 64 128 --sweep-tokens 1 16 64 --budget-s 75 \
  --json "$OUT/moe_decode.json" 2>&1 | tee "$OUT/bench.log" | tail -12
