#!/usr/bin/env bash
# GPU check of programmatic dependent launch (one H200, ≤ 9.5 min): with BREAKGRAPH_PDL=1, the
# cuda tests of the kernels that take PDL and the engine test that compares PDL and plain
# launches bit for bit; then `breakgraph bench decode` (glm5-tp8-rank, bs 1/16/64, 8K context)
# with PDL on and off, and `bench prefill` at 128 and 1024 tokens the same two ways. Summary
# lines last; logs and JSON under $OUT.
#   OUT=/some/dir bash scripts/gpu_check_pdl.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/pdl-out}"
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export BREAKGRAPH_CACHE_DIR="$OUT/cache"   # the FP8 path choice, timed once and shared by both runs
BG="python -m breakgraph.cli"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv > "$OUT/gpu.txt" 2>&1

BREAKGRAPH_PDL=1 timeout 140 python -m pytest -q -m cuda -p no:cacheprovider --maxfail=5 \
  tests/test_kernels_fp8_gemv.py tests/test_kernels_norm.py tests/test_kernels_rope.py tests/test_kernels_causal_topk.py \
  tests/test_kernels_topk.py "tests/test_graphs_engine_cuda.py::test_pdl_decode_graphs_and_prefill_equal_plain_launches" \
  "tests/test_graphs_engine_cuda.py::test_decode_graphs_and_breakable_prefill_generate_like_eager" \
  > "$OUT/pytest_cuda.log" 2>&1
echo "pytest -m cuda (PDL=1): rc=$? ; $(tail -1 "$OUT/pytest_cuda.log")"
grep -aE "^(FAILED|ERROR)|Error:" "$OUT/pytest_cuda.log" | head -12

decode() {  # $1 = PDL value, $2 = extra flags
  BREAKGRAPH_PDL=$1 timeout $3 $BG bench decode --preset glm5-tp8-rank --input-len 1024 --batch-size 1 16 64 \
    --context-length 8192 --steps 20 --rounds 1 --output "$OUT/decode_pdl$1" $2 > "$OUT/decode_pdl$1.log" 2>&1
  echo "bench decode PDL=$1: rc=$?"
}
decode 1 "--top-kernels 12" 150
decode 0 "" 100
for p in 1 0; do
  BREAKGRAPH_PDL=$p timeout 85 $BG bench prefill --preset glm5-tp8-rank --input-len 128 1024 --backends breakable \
    --repeats 3 --output "$OUT/prefill_pdl$p" > "$OUT/prefill_pdl$p.log" 2>&1
  echo "bench prefill PDL=$p: rc=$?"
done
for f in decode_pdl1 decode_pdl0 prefill_pdl1 prefill_pdl0; do
  echo "=== $f"; grep -av "^$" "$OUT/$f.md" 2>/dev/null | cut -c1-400 || tail -5 "$OUT/$f.log"
done
echo "elapsed ${SECONDS}s"
