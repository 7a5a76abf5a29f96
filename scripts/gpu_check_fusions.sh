#!/usr/bin/env bash
# GPU check of the decoder layer's fused kernels (one H200, ≤ 150 s): one decode bench of the
# 12-layer preset (bs 1 and 64, kernels per step and layer; first, so its start-up FP8 timing
# fills the Triton cache the tests then use), the fusions' cuda tests (norm + FP8 quantisation,
# MLA RoPE + latent entry, split-K epilogue, the FP8 model against its twins), and the same bench
# at the commit before the fusions when the checkout has git history and time is left. Table last.
#   OUT=/some/dir bash scripts/gpu_check_fusions.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/fusions-out}"
BEFORE=4786406  # main before the fusions
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,memory.used --format=csv > "$OUT/gpu.txt" 2>&1
BENCH=(bench decode --preset glm5-tp8-rank-12l --input-len 1024 --batch-size 1 64 --context-length 8192
       --steps 10 --rounds 1 --top-kernels 12)

# page 64 in both runs: the tree before the fusions has it fixed (its bench has no --page-size)
timeout 100 python -m breakgraph.cli "${BENCH[@]}" --page-size 64 --output "$OUT/after" > "$OUT/bench_after.log" 2>&1
echo "bench after: rc=$?"
timeout 55 python -m pytest -q -m cuda -p no:cacheprovider -s tests/test_fused_layers_cuda.py \
  tests/test_kernels_norm.py tests/test_kernels_rope.py \
  tests/test_kernels_fp8.py -k "quant or mla or split_k or fused or scaled_mm_path or rope or norm or causal or opcheck" \
  > "$OUT/pytest_cuda.log" 2>&1
echo "pytest -m cuda (fusion tests): rc=$? ; $(tail -1 "$OUT/pytest_cuda.log")"
grep -E "fused vs twins|FAILED|Error" "$OUT/pytest_cuda.log" | head -20

if [ "$SECONDS" -lt 95 ] && git cat-file -e "$BEFORE^{commit}" 2>/dev/null; then
  rm -rf "$OUT/before_src" && mkdir -p "$OUT/before_src"
  git archive "$BEFORE" | tar -x -C "$OUT/before_src"
  (cd "$OUT/before_src" && PYTHONPATH="$PWD" timeout $((145 - SECONDS)) python -m breakgraph.cli "${BENCH[@]}" \
     --output "$OUT/before" > "$OUT/bench_before.log" 2>&1)
  echo "bench before ($BEFORE): rc=$?"
  rm -rf "$OUT/before_src"
else
  echo "bench before: skipped (no git history here or no time left; docs/benchmarks.md has ffc694b's row)"
fi
for side in before after; do
  [ -f "$OUT/$side.md" ] && { echo "== $side"; grep -E "^\|" "$OUT/$side.md" | head -8; }
done
echo "elapsed ${SECONDS}s"
