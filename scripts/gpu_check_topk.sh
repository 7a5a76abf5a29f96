#!/usr/bin/env bash
# GPU check of the DSA top-k select (breakgraph/kernels/triton_topk.py): the select timed at
# prefill 8k / 16k and 64 rows of ~128K keys (defaults and a few block/warp variants; each
# checked against the exact set, beside torch.topk of the same causal rows), then the CUDA
# tests of the select and of the indexer paths that go through it. Logs under $OUT; the table of
# ms per layer comes last. About 60 s on one H200.
set -u
OUT=${OUT:-/tmp/gpu_check_topk}
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
t0=$(date +%s)
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu --format=csv >"$OUT/gpu.txt" 2>&1
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/gpu.txt"
timeout 55 python scripts/bench_kernels_attention.py --only topk >"$OUT/bench.log" 2>&1
echo "bench rc=$? after $(( $(date +%s) - t0 )) s (log: $OUT/bench.log)"
timeout 55 python -m pytest -q -m cuda tests/test_kernels_topk.py tests/test_kernels_attention.py \
    -k "topk or indexer or replay" -p no:cacheprovider >"$OUT/pytest.log" 2>&1
echo "pytest rc=$? after $(( $(date +%s) - t0 )) s (log: $OUT/pytest.log)"; tail -4 "$OUT/pytest.log"
grep -v '^    ' "$OUT/bench.log" | tail -16
