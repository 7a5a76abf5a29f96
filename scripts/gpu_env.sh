# Sourced by the GPU check scripts after `cd` to the repository root: $OUT (default: the first
# argument) made, Python unbuffered, the kernel and FP8-choice caches under $OUT unless
# BREAKGRAPH_CACHE_DIR says otherwise, $PRESET chosen by the card's memory (the 78-layer
# glm5-tp8-rank on an H200, its 12-layer cut on an 80 GB card) unless given; prints the card.
export OUT="${OUT:-$1}" PYTHONUNBUFFERED=1
mkdir -p "$OUT"
export BREAKGRAPH_CACHE_DIR="${BREAKGRAPH_CACHE_DIR:-$OUT/cache}"
mem=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
PRESET=${PRESET:-$([ "${mem:-0}" -gt 100000 ] && echo glm5-tp8-rank || echo glm5-tp8-rank-12l)}
echo "== $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1), preset $PRESET"
