#!/usr/bin/env bash
# GPU check of the decode step at the engine's defaults (one H200, about 9 min): the cuda tests
# of what a decode step runs (the rotary kernels with their cache stores, the fused stores equal
# to the split ops' stores, the route select, PDL bit-identity, decode graphs equal to eager, the
# short-sequence-in-a-long-pool graphs), the demo gate under real breakable, piecewise and decode
# graphs, then `breakgraph bench decode` (glm5-tp8-rank, bs 1/16/64, 8K context) with
# BREAKGRAPH_PDL=auto (the default) against 0, alternated in one process, with the kernels that
# take the most time. Logs and JSON under $OUT.
#   OUT=/some/dir bash scripts/gpu_check_decode_step.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/decode-step-out}"
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export BREAKGRAPH_CACHE_DIR="${BREAKGRAPH_CACHE_DIR:-$OUT/cache}"   # the FP8 path choice, timed once and shared

timeout 200 python -m pytest -q -m cuda -p no:cacheprovider tests/test_kernels_rope.py tests/test_kernels_moe.py \
  tests/test_graphs_engine_cuda.py -k "rope or route or cache_stores or pdl or decode_graphs or short_sequence" \
  > "$OUT/pytest_cuda.log" 2>&1
echo "pytest -m cuda (decode step): rc=$? ; $(tail -1 "$OUT/pytest_cuda.log")"
grep -aE "^(FAILED|ERROR)" "$OUT/pytest_cuda.log" | head -12

timeout 170 python -m pytest -q -m cuda -p no:cacheprovider -s tests/test_demo_gate_cuda.py > "$OUT/demo_gate.log" 2>&1
echo "demo gate (cuda): rc=$? ; $(tail -1 "$OUT/demo_gate.log")"
grep -aE "H200 bf16|^(FAILED|ERROR)" "$OUT/demo_gate.log" | head -8

timeout 190 python -m breakgraph.cli bench decode --preset glm5-tp8-rank --input-len 1024 --batch-size 1 16 64 \
  --context-length 8192 --steps 20 --rounds 2 --pdl auto 0 --top-kernels 12 --output "$OUT/decode" > "$OUT/decode.log" 2>&1
echo "bench decode --pdl auto 0: rc=$?"
grep -aE '^\| ' "$OUT/decode.md" 2>/dev/null || tail -5 "$OUT/decode.log"
echo "elapsed ${SECONDS}s"
