#!/usr/bin/env bash
# GPU check of the sparse MLA kernel past index_topk at glm5-tp8-rank shapes: its CUDA tests
# (8, 16, 64 heads; prefill and decode; graph replay; the FP8 cache at 8 heads), then the tile
# sweep on an 8192-token prefill (8, 16, 64 heads) with gathered TB/s. Logs under $OUT; the
# table of ms and gathered TB/s per shape comes last. About 90 s on one H200.
set -u
OUT=${OUT:-/tmp/gpu_check_sparse_mla}
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee "$OUT/gpu.txt"
timeout 32 python -m pytest -q -m cuda tests/test_kernels_attention.py tests/test_kernels_latent_fp8.py \
    -k "sparse_mla_glm5_shapes or replay_in_cuda_graph or (kernels_on_fp8 and prefill1024 and not 16 and not 64)" \
    -p no:cacheprovider >"$OUT/pytest.log" 2>&1
echo "pytest rc=$? (log: $OUT/pytest.log)"; tail -3 "$OUT/pytest.log"
timeout 54 python scripts/bench_kernels_attention.py --only mla --heads 8 16 64 --sweep --budget 30 \
    --layouts "prefill 8k" >"$OUT/bench.log" 2>&1
echo "bench rc=$? (log: $OUT/bench.log; per-variant lines there)"
grep -v '^    ' "$OUT/bench.log" | tail -10
