#!/usr/bin/env bash
# GPU check of the FP8 MoE dequantisation change (one H200, ≤ 150 s): the MoE cuda tests that
# cover it (every e4m3 code through the bit rebuild, each W8A16 dequantisation mode at GLM-5
# TP8-rank shapes with activations of every magnitude, GEMM 1's quantising epilogue against
# act_quant, the grouped and stream GEMMs at 128 and 1024 tokens, the dispatcher, the decode
# kernels with the scales on the activations at 1, 3, 16 tokens and in a CUDA graph), then the
# comparison at 1, 16, 64, 128, 1024 and 4096 tokens: W8A16 as it was (DEQUANT 0) and as it is,
# its other mode and tiles around its default, W8A8 (+ its activation quantisations, + GEMM 1
# quantising h in its epilogue), the decode kernels before and after at 1 token; µs per GEMM,
# touched-expert TB/s, error against the bf16-activation twin; the summary table last.
#   OUT=/some/dir bash scripts/gpu_check_moe3.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/moe3-out}"
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
start=$(date +%s)
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,memory.used --format=csv > "$OUT/gpu.txt" 2>&1
timeout 85 python -m pytest -q -m cuda tests/test_kernels_moe.py -p no:cacheprovider -s \
  -k "e4m3_bits or x_fp8_on_gpu or quantised_epilogue_gpu or (gpu_glm5_shapes and not 8192 and not decode and not bf16 and not deep) or dispatch_gpu_matches or (decode_gpu_glm5 and True and not 64 and not 128) or decode_cuda_graph" \
  > "$OUT/pytest_cuda.log" 2>&1
echo "pytest -m cuda (MoE dequantisation, stream, dispatch, decode): rc=$? ; $(tail -1 "$OUT/pytest_cuda.log")"
grep -E "rel err|FAILED|Error|passed|failed" "$OUT/pytest_cuda.log" | head -40
timeout 60 python scripts/bench_kernels_moe.py --only compare --sweep-tokens 16 64 1 128 1024 4096 \
  --sweep-jobs 14 --sweep-budget-s 50 --json "$OUT/compare.json" > "$OUT/compare.log" 2>&1
echo "compare: rc=$? ($(( $(date +%s) - start )) s so far)"
head -2 "$OUT/compare.log"
sed -n '/MoE summary/,$p' "$OUT/compare.log"
