#!/usr/bin/env bash
# GPU check of the DSA top-k select (breakgraph/kernels/triton_topk.py): the CUDA tests of the
# select and of the indexer paths that go through it, then the sweep (scripts/bench_topk.py):
# every variant (range / split / the old radix select) at all rows of an 8192- and a
# 16384-token prefill and at 1-64 long rows of 32K and 128K keys, each checked exact, in µs per
# call and ms per 78 layers. Logs under $OUT; the sweep's table comes last. With --quick (the
# select's own tests, the defaults' neighbours on five shapes): on a fresh H100 the tests' first
# compiles took longer than a minute, then 28 s with Triton's cache warm, and the quick sweep 155 s
# (with two sampled-select variants since removed).
set -u
OUT=${OUT:-/tmp/gpu_check_topk}
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
t0=$(date +%s)
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu --format=csv >"$OUT/gpu.txt" 2>&1
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/gpu.txt"
git log -1 --format='commit %h %s' 2>/dev/null | tee -a "$OUT/gpu.txt"
if [ "${1:-}" = "--quick" ]; then
    tests=(tests/test_kernels_topk.py); bench=(--quick); limits=(150 200)
else
    tests=(tests/test_kernels_topk.py tests/test_kernels_attention.py -k "topk or indexer or replay or select")
    bench=(); limits=(90 140)
fi
timeout "${limits[0]}" python -m pytest -q -m cuda "${tests[@]}" -p no:cacheprovider >"$OUT/pytest.log" 2>&1
echo "pytest rc=$? after $(( $(date +%s) - t0 )) s (log: $OUT/pytest.log)"; tail -4 "$OUT/pytest.log"
timeout "${limits[1]}" python scripts/bench_topk.py ${bench[@]+"${bench[@]}"} >"$OUT/bench.log" 2>&1
echo "bench rc=$? after $(( $(date +%s) - t0 )) s (log: $OUT/bench.log)"
if grep -q '^shape ' "$OUT/bench.log"; then grep -v '^    ' "$OUT/bench.log" | tail -80; else tail -60 "$OUT/bench.log"; fi
