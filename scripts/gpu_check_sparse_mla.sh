#!/usr/bin/env bash
# GPU check of the sparse MLA kernel at glm5-tp8-rank shapes (8 heads): its CUDA tests (the lean
# loop in four column groups and in one, on both caches; the FP8 default; prefill and split-K
# decode), the FP8 cache's variants at prefill 8K, then the loop variants against today's
# default on prefill 8K/16K and decode B=1/16/64 at ~8K context: ms, gathered TB/s, largest
# error vs the default. Logs under $OUT; the summary table comes last. At most 4 minutes on one
# H200 (timeouts 45 + 35 + 155 s). SHORT=1: the newest variants' tests only and the shapes
# prefill 8K/16K and decode B=64 (at most 2 minutes: timeouts 25 + 25 + 70 s).
set -u
OUT=${OUT:-/tmp/gpu_check_sparse_mla}
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee "$OUT/gpu.txt"
start=$(date +%s)
tests="sparse_mla_variants_glm5 or fp8_cache_lean_variants or (kernels_on_fp8 and prefill1024 and not 16 and not 64)"
layouts=()
limits=(45 35 155)
if [ "${SHORT:-0}" = 1 ]; then
    tests="(sparse_mla_variants_glm5 and (opts2 or opts3)) or fp8_cache_lean_variants"
    layouts=(--layouts "prefill 8k" "prefill 16k" "decode B=64 (L~8k)")
    limits=(25 25 70)
fi
timeout "${limits[0]}" python -m pytest -q -m cuda tests/test_kernels_attention.py tests/test_kernels_latent_fp8.py \
    -k "$tests" -p no:cacheprovider >"$OUT/pytest.log" 2>&1
echo "pytest rc=$? in $(( $(date +%s) - start )) s (log: $OUT/pytest.log)"; tail -3 "$OUT/pytest.log"
timeout "${limits[1]}" python scripts/bench_kernels_attention.py --variants --heads 8 --kv-cache-dtype fp8_e4m3 \
    --layouts "prefill 8k" >"$OUT/variants_fp8.log" 2>&1
echo "fp8 variants rc=$? (log: $OUT/variants_fp8.log)"; tail -1 "$OUT/variants_fp8.log"
timeout "${limits[2]}" python scripts/bench_kernels_attention.py --variants --heads 8 ${layouts[@]+"${layouts[@]}"} \
    >"$OUT/variants.log" 2>&1
echo "variants rc=$? (log: $OUT/variants.log; per-variant lines there)"
grep -v '^    ' "$OUT/variants.log" | tail -8
echo "total $(( $(date +%s) - start )) s"
