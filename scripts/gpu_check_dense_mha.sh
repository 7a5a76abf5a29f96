#!/usr/bin/env bash
# GPU check of the MHA form for prefill tokens below index_topk, the MoE alignment's block
# writes and PDL at short prefills (about 9 min on one H200 at glm5-tp8-rank): the cuda tests
# (the kernel at GLM-5 shapes with and without key chunks, both forms against fp32, the engine on
# prefixes, long prompts and the FP8 cache, the graph backends against eager, the demo gate, the
# MoE at GLM-5 shapes), the kernel sweep (`scripts/bench_dense_mha.py --sweep`), then `bench
# prefill` at 128, 1024 and 8192 tokens in each form (BREAKGRAPH_DENSE_MHA=auto, then 0) with the
# top kernels, and 128 tokens with BREAKGRAPH_PDL=0 (auto launches them with PDL). Logs under
# $OUT; the tables last.
#   OUT=/some/dir [PRESET=glm5-tp8-rank-12l] bash scripts/gpu_check_dense_mha.sh
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/gpu_env.sh /tmp/dense-mha-out
SECONDS=0
timeout 80 python scripts/bench_dense_mha.py --tokens 1024 2048 --sweep --budget 60 > "$OUT/bench_dense_mha.log" 2>&1
echo "bench_dense_mha: rc=$? t=${SECONDS}s"
for mode in auto 0; do
  BREAKGRAPH_DENSE_MHA=$mode timeout 120 python -m breakgraph.cli bench prefill --preset "$PRESET" \
    --input-len 128 1024 8192 --backends breakable --repeats 5 --top-kernels 12 > "$OUT/prefill_mha_$mode.log" 2>&1
  echo "prefill, BREAKGRAPH_DENSE_MHA=$mode: rc=$? t=${SECONDS}s"; grep -aE '^\| breakable ' "$OUT/prefill_mha_$mode.log"
done
BREAKGRAPH_PDL=0 timeout 60 python -m breakgraph.cli bench prefill --preset "$PRESET" --input-len 128 \
  --backends breakable --repeats 10 > "$OUT/prefill_pdl_0.log" 2>&1
echo "prefill 128, BREAKGRAPH_PDL=0: rc=$? t=${SECONDS}s"; grep -aE '^\| breakable ' "$OUT/prefill_pdl_0.log"
timeout $((560 - SECONDS)) python -m pytest -q -s -m cuda -p no:cacheprovider -p no:logging -rA \
  tests/test_kernels_dense_mha.py tests/test_dsa_surface.py tests/test_graphs_engine_cuda.py tests/test_demo_gate_cuda.py \
  tests/test_kernels_moe.py::test_fused_moe_gpu_glm5_shapes tests/test_kernels_moe.py::test_moe_layer_cuda_graph_replay \
  > "$OUT/pytest.log" 2>&1
echo "cuda tests: rc=$? $(tail -1 "$OUT/pytest.log") t=${SECONDS}s"; grep -a '^FAILED\|^ERROR\|error against fp32' "$OUT/pytest.log"
grep -a -B2 -A12 'best tile' "$OUT/bench_dense_mha.log" | head -30
