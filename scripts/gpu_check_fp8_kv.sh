#!/usr/bin/env bash
# The FP8 latent KV cache on one GPU, in steps with their own time limits (≈150 s in all):
#   1. its CUDA tests (kernels vs twins at GLM-5 shapes, 8/16/64 heads; store; graph replay) and
#      the bf16 sparse-MLA tests the shared load helper touches;
#   2. the demo gate on the GPU with both caches and the engine-level FP8-vs-bf16 figures;
#   3. sparse / dense-causal MLA kernel times, bf16 vs FP8 cache, 8 heads, 8192 and 16384 tokens;
#   4. a few FP8 tile choices of the sparse kernel.
# RUN_PREFILL=1 adds 5. `breakgraph bench prefill --preset glm5-tp8-rank --input-len 8192 ...
# --kv-cache-dtype fp8_e4m3` (loads 95 GB of dummy weights: over the 150 s on its own).
# Logs go under $OUT (default ./gpu_check_fp8_kv); the tables are printed last.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_check_fp8_kv}
mkdir -p "$OUT"
t0=$(date +%s)
stamp() { echo "[$(( $(date +%s) - t0 )) s] $*"; }

stamp "1. CUDA tests (log: $OUT/pytest_cuda.log)"
timeout 70 python -m pytest -q -s -m cuda tests/test_kernels_latent_fp8.py \
  "tests/test_kernels_attention.py::test_sparse_mla_glm5_shapes_on_gpu" \
  "tests/test_kernels_attention.py::test_sparse_mla_dense_causal_path_glm5_shapes_on_gpu" \
  > "$OUT/pytest_cuda.log" 2>&1
echo "rc $?"; grep -E "fp8 cache H=|passed|failed|Error" "$OUT/pytest_cuda.log" | tail -30

stamp "2. demo gate on the GPU, bf16 vs FP8 cache (log: $OUT/gate.log)"
timeout 40 python -m pytest -q -s -m cuda tests/test_kv_cache_fp8.py > "$OUT/gate.log" 2>&1
echo "rc $?"; grep -E "demo gate|passed|failed|Error" "$OUT/gate.log" | tail -8
timeout 20 python scripts/kv_cache_accuracy.py --device cuda --models demo > "$OUT/accuracy.log" 2>&1
grep "vs auto" "$OUT/accuracy.log"

stamp "3. kernel times: prefill 2k = dense-causal only; 8k/16k = dense below K + sparse past it ([sparse only]: all sparse)"
timeout 45 python scripts/bench_kernels_attention.py --only mla --heads 8 --kv-cache-dtype bfloat16 fp8_e4m3 \
  --layouts "prefill 2k" "prefill 8k" "prefill 16k" "decode B=64 (L~16k)" > "$OUT/kernels.log" 2>&1
echo "rc $?"

stamp "4. FP8 tile choices, sparse kernel, 8 heads (log: $OUT/sweep.log)"
timeout 35 python scripts/bench_kernels_attention.py --only mla --heads 8 --kv-cache-dtype fp8_e4m3 --sweep \
  --sweep-fp8-small --layouts "prefill 8k" "decode B=64 (L~16k)" > "$OUT/sweep.log" 2>&1
echo "rc $?"

if [ "${RUN_PREFILL:-0}" = 1 ]; then
  stamp "5. bench prefill glm5-tp8-rank 8192, FP8 cache (log: $OUT/prefill_fp8.log)"
  python -m breakgraph.cli bench prefill --preset glm5-tp8-rank --input-len 8192 --backends breakable --repeats 2 \
    --top-kernels 8 --kv-cache-dtype fp8_e4m3 --output "$OUT/prefill_fp8" > "$OUT/prefill_fp8.log" 2>&1
  echo "rc $?"; grep -E "KV tokens|floor 1|^  +[0-9]|^\|" "$OUT/prefill_fp8.log" | tail -20
fi
stamp "done; tables:"
grep -E "FP8 tile|best|    +[0-9.]+ ms" "$OUT/sweep.log" | tail -14
cat "$OUT/kernels.log" | tail -14
