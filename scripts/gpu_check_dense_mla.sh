#!/usr/bin/env bash
# GPU check of the dense-causal MLA kernels (breakgraph/kernels/triton_dense_mla.py): their CUDA
# tests, then the chunked kernel (the default) against the balanced one (BREAKGRAPH_DENSE_MLA_BALANCED=1)
# and a sweep of the balanced kernel's key block / stages / forward grid / bf16 partials at 8 heads,
# fresh prompts of 1024 and 8192 tokens, pages of 16 and 64; µs per layer and ms over 78 layers,
# the table last. Logs under $OUT.
# At most 120 s on one H200 (the kernel's own CUDA tests ≤ 35 s, the dispatcher's ≤ 25 s, bench ≤ 55 s;
# stopped early, the bench still prints the table of what it measured).
set -u
OUT=${OUT:-/tmp/gpu_check_dense_mla}
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu --format=csv >"$OUT/gpu.txt" 2>&1
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/gpu.txt"
timeout 35 python -m pytest -q -m cuda tests/test_kernels_attention.py -k "dense_mla_pages" -p no:cacheprovider \
    >"$OUT/pytest.log" 2>&1
echo "pytest (dense kernel) rc=$? (log: $OUT/pytest.log)"; tail -3 "$OUT/pytest.log"
timeout 25 python -m pytest -q -m cuda tests/test_kernels_attention.py -k "dense_causal_path" -p no:cacheprovider \
    >"$OUT/pytest_dispatch.log" 2>&1
echo "pytest (dispatcher's dense path) rc=$? (log: $OUT/pytest_dispatch.log)"; tail -3 "$OUT/pytest_dispatch.log"
timeout -k 3 55 python scripts/bench_dense_mla.py --heads 8 --tokens 1024 8192 --pages 16 64 --sweep --budget 40 \
    >"$OUT/bench.log" 2>&1
echo "bench rc=$? (log: $OUT/bench.log; per-variant lines there)"
grep -v '^    ' "$OUT/bench.log" | tail -8
