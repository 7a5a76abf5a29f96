#!/usr/bin/env bash
# GPU check of the sparse MLA kernel at glm5-tp8-rank shapes (8 heads), at most 150 s on one
# H200: its CUDA tests (the column-group kernel on the bf16 and FP8 caches, its tile variants,
# the FP8 scales on the columns with the inline-PTX e4m3 conversion checked against torch's
# cast; prefill and split-K decode), then the loop variants against the default on both caches
# at prefill 8K/16K and decode B=64/B=1 (~8K context): ms, gathered TB/s, largest error vs the
# default; the summary table comes last (with the default's ms × 78 layers). If a
# {'fp8_columns': True, ...} row is the FP8 best, BREAKGRAPH_SPARSE_MLA_FP8=columns turns it on
# (its default: default_config's fp8_columns). Logs under $OUT (timeouts 55 + 90 s; the sweep times
# only the defaults once 70 s are spent).
set -u
OUT=${OUT:-/tmp/gpu_check_sparse_mla}
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee "$OUT/gpu.txt"
start=$(date +%s)
tests="sparse_mla_variants_glm5 or fp8_cache_lean_variants or e4m3_codes_in_ptx"
tests="$tests or (kernels_on_fp8_cache_match_twin and 16)"  # 16 heads: the FP8 prefill default there (the slots loop)
timeout 55 python -m pytest -q -m cuda tests/test_kernels_attention.py tests/test_kernels_latent_fp8.py \
    -k "$tests" -p no:cacheprovider >"$OUT/pytest.log" 2>&1
echo "pytest rc=$? in $(( $(date +%s) - start )) s (log: $OUT/pytest.log)"; tail -3 "$OUT/pytest.log"
timeout 90 python scripts/bench_kernels_attention.py --variants --heads 8 --kv-cache-dtype bfloat16 fp8_e4m3 \
    --layouts "prefill 8k" "prefill 16k" "decode B=64 (L~8k)" "decode B=1 (L~8k)" --budget 70 \
    >"$OUT/variants.log" 2>&1
echo "variants rc=$? (log: $OUT/variants.log; per-variant lines there)"
grep -v '^    ' "$OUT/variants.log" | tail -10
echo "total $(( $(date +%s) - start )) s"
