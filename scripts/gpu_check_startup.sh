#!/usr/bin/env bash
# GPU check of the engine's start-up (one H200, ≤ 180 s): glm5-tp8-rank with dummy weights and
# the server's default settings, started twice — cold (a fresh Triton cache and a fresh FP8 GEMM
# choice cache) and warm (both kept from the cold run) — each printing its `ready in …` parts,
# the buckets captured and how many needed a warm-up. The warm run then times TTFT at the
# coarse ladder's bucket sizes and just above some (padding), and re-captures two prefill
# buckets and two decode batch sizes under cProfile (functions with the most own time). Between
# the two, the tiny models' graphs-vs-eager cuda tests (captures with one warm-up per ladder).
#   OUT=/some/dir bash scripts/gpu_check_startup.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/startup-out}"
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export TRITON_CACHE_DIR="/tmp/breakgraph-startup-triton-$$"  # cold for the first run, kept for the second
export BREAKGRAPH_CACHE_DIR="$OUT/cache"
rm -rf "$TRITON_CACHE_DIR" "$BREAKGRAPH_CACHE_DIR"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,memory.used --format=csv > "$OUT/gpu.txt" 2>&1
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" >> "$OUT/gpu.txt" 2>&1

timeout 140 python scripts/startup_times.py --preset glm5-tp8-rank > "$OUT/cold.log" 2>&1
echo "cold start: rc=$? (${SECONDS}s)"
# graphs captured with one warm-up (the Triton guard retrying where a kernel would compile) vs eager
timeout 45 python -m pytest -q -m cuda -p no:cacheprovider tests/test_graphs_engine_cuda.py \
  -k "tiny_models_graph_backends_equal_eager or decode_graphs_and_breakable" > "$OUT/pytest_cuda.log" 2>&1
echo "pytest -m cuda (graphs vs eager, tiny models): rc=$? ; $(tail -1 "$OUT/pytest_cuda.log") (${SECONDS}s)"
LEFT=$((175 - SECONDS))
if [ "$LEFT" -gt 40 ]; then
  timeout "$LEFT" python scripts/startup_times.py --preset glm5-tp8-rank --repeats 3 --profile 256 1024 \
    --ttft 128 256 257 384 512 513 768 1024 1025 1280 1536 2048 2049 2560 3072 4096 > "$OUT/warm.log" 2>&1
  echo "warm start: rc=$? (${SECONDS}s)"
else
  echo "warm start: skipped (${LEFT}s left)"
fi
rm -rf "$TRITON_CACHE_DIR"
for run in cold warm; do
  [ -f "$OUT/$run.log" ] || continue
  echo "== $run"
  grep -E "fp8 linears: GEMM paths|prefill graphs \(|decode graphs:|ready in|unreadable|without warm-up failed|Traceback|Error" \
    "$OUT/$run.log" | sed -E 's/^[0-9-]+ [0-9:,]+ //' | head -12
  grep -E '^\{"preset"|^ttft |^profiled' "$OUT/$run.log"
done
echo "elapsed ${SECONDS}s"
