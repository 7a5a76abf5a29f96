#!/usr/bin/env bash
# GPU check of the sparse MLA kernel past index_topk (the few-heads swap-AB tile): its CUDA
# tests (bf16 and FP8 caches, graph replay), the sweep of tiles at glm5-tp8-rank shapes (8, 16,
# 64 heads; 8k and 16k prefills) with gathered TB/s, the FP8 cache at 8k, and an ncu summary
# of one launch each of the tile before swap-AB and of the default. Logs under $OUT; the table
# of ms and gathered TB/s per shape comes last. About 150 s on one H200.
set -u
OUT=${OUT:-/tmp/gpu_check_sparse_mla}
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu --format=csv >"$OUT/gpu.txt" 2>&1
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/gpu.txt"
timeout 45 python -m pytest -q -m cuda tests/test_kernels_attention.py tests/test_kernels_latent_fp8.py \
    -k "sparse_mla or replay or kernels_on_fp8 or fp8_cache_step" -p no:cacheprovider >"$OUT/pytest.log" 2>&1
echo "pytest rc=$? (log: $OUT/pytest.log)"; tail -3 "$OUT/pytest.log"
timeout 72 python scripts/bench_kernels_attention.py --only mla --heads 8 16 64 --sweep --budget 30 \
    --layouts "prefill 8k" "prefill 16k" >"$OUT/bench.log" 2>&1
echo "bench rc=$? (log: $OUT/bench.log; per-variant lines there)"
timeout 15 python scripts/bench_kernels_attention.py --only mla --heads 8 --kv-cache-dtype fp8_e4m3 \
    --layouts "prefill 8k" --sweep --sweep-fp8-small --budget 4 >"$OUT/bench_fp8.log" 2>&1
echo "fp8 bench rc=$? (log: $OUT/bench_fp8.log)"
if command -v ncu >/dev/null; then
    timeout 18 ncu --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy \
        --section WarpStateStats --csv -k regex:_sparse_mla_fwd --launch-count 2 \
        python scripts/ncu_sparse_mla.py >"$OUT/ncu.csv" 2>"$OUT/ncu.err"
    echo "ncu rc=$? (log: $OUT/ncu.csv; launch 1: the tile before swap-AB, launch 2: the default)"
else
    echo "ncu not found: no profile"
fi
grep -E "^ +[0-9.]+ ms|best" "$OUT/bench_fp8.log" | tail -4
grep -v '^    ' "$OUT/bench.log" | tail -16
