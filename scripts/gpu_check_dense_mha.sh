#!/usr/bin/env bash
# GPU check of dense-causal MLA in MHA form (about 6 min on one H200 at glm5-tp8-rank): its cuda
# tests (the kernel at GLM-5 shapes with and without key chunks, both forms against fp32, the
# engine on prefixes and the FP8 cache, the graph backends against eager), the kernel sweep
# (`scripts/bench_dense_mha.py --sweep`), then `bench prefill` at 128 and 1024 tokens in each form
# (BREAKGRAPH_DENSE_MHA=auto, then 0) with the top kernels. Logs under $OUT; the tables last.
#   OUT=/some/dir [PRESET=glm5-tp8-rank-12l] bash scripts/gpu_check_dense_mha.sh
set -uo pipefail
cd "$(dirname "$0")/.."
export OUT="${OUT:-/tmp/dense-mha-out}" PYTHONUNBUFFERED=1
mkdir -p "$OUT"
export BREAKGRAPH_CACHE_DIR="${BREAKGRAPH_CACHE_DIR:-$OUT/cache}"
mem=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
PRESET=${PRESET:-$([ "${mem:-0}" -gt 100000 ] && echo glm5-tp8-rank || echo glm5-tp8-rank-12l)}
echo "== $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1), preset $PRESET"
timeout 240 python -m pytest -q -s -m cuda -p no:cacheprovider -p no:logging tests/test_kernels_dense_mha.py \
  tests/test_graphs_engine_cuda.py -k "mha or mid_size or short_prompts" > "$OUT/pytest.log" 2>&1
echo "cuda tests: rc=$? $(tail -1 "$OUT/pytest.log")"; grep -a '^FAILED\|error against fp32' "$OUT/pytest.log"
timeout 150 python scripts/bench_dense_mha.py --tokens 128 1024 2048 --sweep --budget 100 > "$OUT/bench_dense_mha.log" 2>&1
echo "bench_dense_mha: rc=$?"
for mode in auto 0; do
  BREAKGRAPH_DENSE_MHA=$mode timeout 150 python -m breakgraph.cli bench prefill --preset "$PRESET" --input-len 128 1024 \
    --backends breakable --repeats 10 --top-kernels 8 > "$OUT/prefill_mha_$mode.log" 2>&1
  echo "prefill, BREAKGRAPH_DENSE_MHA=$mode: rc=$?"; grep -aE '^\| breakable ' "$OUT/prefill_mha_$mode.log"
done
tail -6 "$OUT/bench_dense_mha.log"
