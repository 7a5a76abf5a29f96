#!/usr/bin/env bash
# GPU check of sparse MLA doing only the work a batch has (about 5 min per tree on one H200): the
# attention and top-k cuda tests (packed and causal decode rows at GLM-5 shapes, bf16 and FP8
# cache; the dense path), the engine's graph tests and the demo gate (every prefill of a short
# prompt skips the sparse launch, every decode step stops its rows at their keys, prefill graphs
# store the cache rows from the rotary kernels, short prompts and decode steps over short contexts
# compute no indexer queries), then `bench decode` at batch
# 1, 16 and 64 and `bench prefill` at 128 and 1024 tokens (scripts/gpu_bench_trees.sh; with
# BASE=<commit>, or BASE_TREE=<folder holding that commit's breakgraph/>, at that commit too, on
# the same machine). Logs under $OUT.
#   OUT=/some/dir [BASE=d162407 | BASE_TREE=dir] [PRESET=glm5-tp8-rank-12l] bash scripts/gpu_check_sparse_work.sh
set -uo pipefail
cd "$(dirname "$0")/.."
export OUT="${OUT:-/tmp/sparse-work-out}" DECODE_BATCHES="${DECODE_BATCHES:-1 16 64}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 BREAKGRAPH_CACHE_DIR="${BREAKGRAPH_CACHE_DIR:-$OUT/cache}"
echo "== $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)"
timeout 300 python -m pytest -q -m cuda -p no:cacheprovider tests/test_kernels_attention.py tests/test_kernels_topk.py \
  tests/test_kernels_rope.py tests/test_graphs_engine_cuda.py tests/test_demo_gate_cuda.py \
  -k "packed or dense or glm5_shapes or graph or gate or select or rope or causal" > "$OUT/pytest.log" 2>&1
echo "cuda tests: rc=$? $(tail -1 "$OUT/pytest.log")"; grep -a '^FAILED' "$OUT/pytest.log"
bash scripts/gpu_bench_trees.sh  # BASE, PRESET, OUT and DECODE_BATCHES pass through
echo "elapsed ${SECONDS}s"
