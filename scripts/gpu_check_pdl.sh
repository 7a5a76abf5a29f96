#!/usr/bin/env bash
# GPU check of programmatic dependent launch (one H200, ≤ 6 min): with BREAKGRAPH_PDL=1 the engine
# test that compares PDL and plain launches bit for bit (breakable prefill and decode graphs,
# FP8 weights) and the decode-graphs-equal-eager test; then `breakgraph bench decode`
# (glm5-tp8-rank, bs 1/16/64, 8K context) timing both settings in one process, alternated over
# three rounds, and `bench prefill` at 128 and 1024 tokens with PDL off, then on. Logs and
# JSON under $OUT.
#   OUT=/some/dir bash scripts/gpu_check_pdl.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/pdl-out}"
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export BREAKGRAPH_CACHE_DIR="${BREAKGRAPH_CACHE_DIR:-$OUT/cache}"   # the FP8 path choice, timed once and shared
BG="python -m breakgraph.cli"

BREAKGRAPH_PDL=1 timeout 150 python -m pytest -q -m cuda -p no:cacheprovider \
  "tests/test_graphs_engine_cuda.py::test_pdl_decode_graphs_and_prefill_equal_plain_launches" \
  "tests/test_graphs_engine_cuda.py::test_decode_graphs_and_breakable_prefill_generate_like_eager" \
  > "$OUT/pytest_cuda.log" 2>&1
echo "pytest -m cuda (PDL=1): rc=$? ; $(tail -1 "$OUT/pytest_cuda.log")"
grep -aE "^(FAILED|ERROR)|Error" "$OUT/pytest_cuda.log" | head -12

timeout 220 $BG bench decode --preset glm5-tp8-rank --input-len 1024 --batch-size 1 16 64 --context-length 8192 \
  --steps 20 --rounds 3 --pdl 1 0 --output "$OUT/decode_ab" > "$OUT/decode_ab.log" 2>&1
echo "bench decode --pdl 1 0: rc=$?"
grep -av '^$' "$OUT/decode_ab.md" 2>/dev/null || tail -5 "$OUT/decode_ab.log"
for p in 0 1; do
  BREAKGRAPH_PDL=$p timeout 80 $BG bench prefill --preset glm5-tp8-rank --input-len 128 1024 --backends breakable \
    --repeats 5 --output "$OUT/prefill_pdl$p" > "$OUT/prefill_pdl$p.log" 2>&1
  echo "bench prefill PDL=$p: rc=$?"
  grep -aE '^\| breakable' "$OUT/prefill_pdl$p.md" 2>/dev/null || tail -3 "$OUT/prefill_pdl$p.log"
done
echo "elapsed ${SECONDS}s"
