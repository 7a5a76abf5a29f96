#!/usr/bin/env bash
# GPU check of the dense-causal MLA path (key chunks + merge): its CUDA tests, then the old
# kernel against the new one and a sweep of key block / stages / chunk size at glm5-tp8-rank
# shapes (8, 16, 64 heads; 1k fresh, 1k on a 1k prefix, 8k). Logs under $OUT; the table of
# µs per layer comes last. About 150 s on one H200.
set -u
OUT=${OUT:-/tmp/gpu_check_dense_mla}
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu --format=csv >"$OUT/gpu.txt" 2>&1
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/gpu.txt"
timeout 70 python -m pytest -q -m cuda tests/test_kernels_attention.py -k "sparse_mla or dense or replay" \
    -p no:cacheprovider >"$OUT/pytest.log" 2>&1
echo "pytest rc=$? (log: $OUT/pytest.log)"; tail -3 "$OUT/pytest.log"
timeout 100 python scripts/bench_kernels_attention.py --only dense --heads 8 16 64 --sweep --budget 60 \
    >"$OUT/bench.log" 2>&1
echo "bench rc=$? (log: $OUT/bench.log; per-variant lines there)"
grep -v '^    ' "$OUT/bench.log" | tail -12
