#!/usr/bin/env bash
# The FP8 latent KV cache on one GPU: its CUDA tests, sparse / dense MLA kernel times on a bf16
# and an FP8 cache (8 heads, 8192 and 16384 tokens, a few FP8 tile choices), and the glm5-tp8-rank
# prefill with the FP8 cache. Logs go under $OUT (default: ./gpu_check_fp8_kv); the last lines
# printed are the tables. Skip the prefill bench with SKIP_PREFILL=1.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_check_fp8_kv}
mkdir -p "$OUT"
t0=$(date +%s)
stamp() { echo "[$(( $(date +%s) - t0 )) s] $*"; }

stamp "1. CUDA tests"
python -m pytest -q -s -m cuda tests/test_kernels_latent_fp8.py tests/test_kv_cache_fp8.py tests/test_kernels_attention.py 2>&1 | tee "$OUT/pytest_cuda.log" | grep -E "fp8 cache|demo gate|passed|failed|Error" | tail -60

stamp "1b. FP8 vs bf16 cache through the engine on the GPU (demo model; tiny models)"
python scripts/kv_cache_accuracy.py --device cuda --models demo glm5-tiny dsv32-tiny 2>&1 | tee "$OUT/accuracy.log" | grep "vs auto"

stamp "2. kernel times: sparse MLA (prefill 8k/16k: dense-causal below K + sparse past it; [sparse only]), dense-causal MLA (prefill 2k: all tokens below K), bf16 vs FP8 cache"
python scripts/bench_kernels_attention.py --only mla --heads 8 --kv-cache-dtype bfloat16 fp8_e4m3 \
  --layouts "prefill 2k" "prefill 8k" "prefill 16k" "decode B=64 (L~16k)" 2>&1 | tee "$OUT/kernels.log"

stamp "3. FP8 tile choices (sparse kernel, 8 heads)"
python scripts/bench_kernels_attention.py --only mla --heads 8 --kv-cache-dtype fp8_e4m3 --sweep --sweep-fp8-small \
  --layouts "prefill 8k" "decode B=64 (L~16k)" 2>&1 | tee "$OUT/sweep.log" | grep -E "best|ms  gathered|Error"

if [ "${SKIP_PREFILL:-0}" != 1 ]; then
  stamp "4. breakgraph bench prefill --kv-cache-dtype fp8_e4m3 (glm5-tp8-rank, 8192 tokens)"
  breakgraph bench prefill --preset glm5-tp8-rank --input-len 8192 --backends breakable --repeats 2 --top-kernels 8 \
    --kv-cache-dtype fp8_e4m3 --output "$OUT/prefill_fp8" 2>&1 | tee "$OUT/prefill_fp8.log" \
    | grep -E "KV tokens|floor|top kernels|^  +[0-9]|^\|" | tail -30
fi
stamp "done"
