#!/usr/bin/env bash
# GPU check of the engine's start-up (one H200, ≤ 120 s): glm5-tp8-rank with dummy weights and
# the server's default settings, started cold (a fresh Triton cache and a fresh FP8 GEMM choice
# cache), printing its `ready in …` parts, the buckets captured, how many needed a warm-up and
# what was compiled ahead; then the tiny models' graphs-vs-eager cuda tests (captures after one
# warm-up per ladder, each warm-up after a compile-ahead dry run); then, with the time left, a
# warm start (both caches kept) that also times TTFT at a few prompt lengths.
#   OUT=/some/dir bash scripts/gpu_check_startup.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/startup-out}"
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export TRITON_CACHE_DIR="/tmp/breakgraph-startup-triton-$$"  # cold for the first run, kept for the last
export BREAKGRAPH_CACHE_DIR="$OUT/cache"
rm -rf "$TRITON_CACHE_DIR" "$BREAKGRAPH_CACHE_DIR"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,memory.used --format=csv > "$OUT/gpu.txt" 2>&1
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" >> "$OUT/gpu.txt" 2>&1

timeout 80 python scripts/startup_times.py --preset glm5-tp8-rank > "$OUT/cold.log" 2>&1
echo "cold start: rc=$? (${SECONDS}s)"
timeout 35 python -m pytest -q -m cuda -p no:cacheprovider tests/test_graphs_engine_cuda.py \
  -k "tiny_models_graph_backends_equal_eager or decode_graphs_and_breakable" > "$OUT/pytest_cuda.log" 2>&1
echo "pytest -m cuda (graphs vs eager, tiny models): rc=$? ; $(tail -1 "$OUT/pytest_cuda.log") (${SECONDS}s)"
LEFT=$((118 - SECONDS))
if [ "$LEFT" -gt 30 ]; then
  timeout "$LEFT" python scripts/startup_times.py --preset glm5-tp8-rank --repeats 2 \
    --ttft 8 64 256 1024 1025 2048 4096 > "$OUT/warm.log" 2>&1
  echo "warm start: rc=$? (${SECONDS}s)"
else
  echo "warm start: skipped (${LEFT}s left)"
fi
rm -rf "$TRITON_CACHE_DIR"
for run in cold warm; do
  [ -f "$OUT/$run.log" ] || continue
  echo "== $run"
  grep -E "fp8 linears: GEMM paths|prefill graphs \(|decode graphs:|ready in|Triton:|ahead|dry run|unreadable|without a warm-up|Traceback|Error" \
    "$OUT/$run.log" | sed -E 's/^[0-9-]+ [0-9:,]+ //' | head -14
  grep -E '^\{"preset"|^ttft ' "$OUT/$run.log"
done
echo "elapsed ${SECONDS}s"
