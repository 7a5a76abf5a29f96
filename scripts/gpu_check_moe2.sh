#!/usr/bin/env bash
# GPU check of the FP8 MoE grouped GEMMs (one H200, ≤ 4 min): the stream kernel's and the
# dispatcher's cuda tests, then the GEMM sweep (the default configs against the grouped and the
# stream kernel's tiles, W8A16 and W8A8) at decode 1…64 and prefill 128…4096 tokens, uniform
# random routing: µs per call, touched-expert TB/s, relative error against the twin; then the
# layer table (the default dispatch, the decode kernels, the best GEMM pair per activation
# kind), last.
#   OUT=/some/dir bash scripts/gpu_check_moe2.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/moe2-out}"
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,memory.used --format=csv > "$OUT/gpu.txt" 2>&1
timeout 60 python -m pytest -q -m cuda tests/test_kernels_moe.py -p no:cacheprovider -s \
  -k "stream_kernel_gpu or (dispatch_gpu_matches and True)" > "$OUT/pytest_cuda.log" 2>&1
echo "pytest -m cuda (stream + dispatch tests): rc=$? ; $(tail -1 "$OUT/pytest_cuda.log")"
grep -E "rel err|FAILED|Error" "$OUT/pytest_cuda.log" | head -20
timeout 175 python scripts/bench_kernels_moe.py --only sweep --sweep-tokens 16 64 8 32 1024 128 4096 1 \
  --sweep-jobs 14 --sweep-budget-s 120 --json "$OUT/sweep.json" > "$OUT/sweep.log" 2>&1
echo "sweep: rc=$?"
head -3 "$OUT/sweep.log"
sed -n '/sweep summary/,$p' "$OUT/sweep.log"
