#!/usr/bin/env bash
# GPU check of the FP8 linears' self-quantising W8A8 GEMM (about 6 min on one H200 at
# glm5-tp8-rank): its cuda tests (bit for bit the W8A8 GEMM's result at GLM-5 TP8 shapes, the
# start-up timing and dispatch over every path), then `bench decode` at batch 1, 16 and 64 with
# the path tried by the start-up timing (BREAKGRAPH_FP8_FUSED_QUANT=1, the default) and without
# it (=0), one process each, and the paths each start-up chose (its `fp8 linear K=… N=…` log
# lines). Logs under $OUT.
#   OUT=/some/dir [PRESET=glm5-tp8-rank-12l] bash scripts/gpu_check_fused_quant.sh
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/gpu_env.sh /tmp/fused-quant-out
SECONDS=0
timeout 150 python -m pytest -q -m cuda -p no:cacheprovider -p no:logging tests/test_kernels_fp8.py \
  -k "glm5_shapes or tunes_and_dispatches or graph_replay" > "$OUT/pytest.log" 2>&1
echo "cuda tests: rc=$? $(tail -1 "$OUT/pytest.log") t=${SECONDS}s"; grep -a '^FAILED' "$OUT/pytest.log"
for mode in 1 0; do
  BREAKGRAPH_FP8_FUSED_QUANT=$mode timeout 180 python -m breakgraph.cli bench decode --preset "$PRESET" --input-len 1024 \
    --batch-size 1 16 64 --context-length 8192 --steps 20 --rounds 2 --top-kernels 8 \
    --output "$OUT/decode_fused_$mode" > "$OUT/decode_fused_$mode.log" 2>&1
  echo "decode, BREAKGRAPH_FP8_FUSED_QUANT=$mode: rc=$? t=${SECONDS}s"
  grep -aE '^\| [0-9]' "$OUT/decode_fused_$mode.log" | head -4
  grep -a 'fp8 linear K=' "$OUT/decode_fused_$mode.log" | sed 's/.*fp8 linear/  fp8 linear/' | head -12
done
