#!/bin/bash
# Serving benchmark of a bench preset with dummy weights: writes the preset's model folder
# (config + a tokenizer covering its vocabulary), starts `breakgraph serve` on 127.0.0.1, waits
# for /health, then runs `breakgraph bench serve` once per concurrency with all requests sent at
# once (4× the concurrency, 8 at concurrency 1). Prints the server's start-up line and each
# summary; JSON results and logs go to $OUT.
#
#   OUT=serve_out bash scripts/serve_bench.sh                       # glm5-tp8-rank, 1 16 64
#   PRESET=glm5-tp8-rank-12l CONCURRENCY="1 16" OUT=o bash scripts/serve_bench.sh
set -euo pipefail
PRESET=${PRESET:-glm5-tp8-rank}
CONCURRENCY=${CONCURRENCY:-"1 16 64"}
INPUT_LEN=${INPUT_LEN:-1024}
OUTPUT_LEN=${OUTPUT_LEN:-256}
PORT=${PORT:-30000}
OUT=${OUT:?set OUT to a folder for the results}
BG=${BG:-"python3 -m breakgraph.cli"}
mkdir -p "$OUT"
FOLDER="$OUT/$PRESET"
$BG bench model-folder --preset "$PRESET" --out "$FOLDER" > "$OUT/model_folder.log" 2>&1
start=$(date +%s.%N)
$BG serve --model-path "$FOLDER" --load-format dummy --host 127.0.0.1 --port "$PORT" \
    --uvicorn-log-level warning > "$OUT/serve.log" 2>&1 &
server=$!
trap 'kill $server 2>/dev/null || true' EXIT
until python3 -c "import httpx, sys; sys.exit(httpx.get('http://127.0.0.1:$PORT/health', timeout=2).status_code != 200)" 2>/dev/null; do
    kill -0 $server 2>/dev/null || { echo "server exited:"; tail -20 "$OUT/serve.log"; exit 1; }
    sleep 1
done
echo "server healthy $(python3 -c "print(round($(date +%s.%N) - $start, 1))") s after launch"
grep -E "ready in|KV cache|captured in|serving" "$OUT/serve.log" | cut -c1-260
for c in $CONCURRENCY; do
    n=$(( c == 1 ? 8 : 4 * c ))
    echo "=== concurrency $c, $n requests"
    $BG bench serve --base-url "http://127.0.0.1:$PORT" --num-prompts "$n" --max-concurrency "$c" \
        --input-len "$INPUT_LEN" --output-len "$OUTPUT_LEN" --tokenizer "$FOLDER" --no-progress \
        --output "$OUT/serve_c$c.json" 2>&1 | tee "$OUT/serve_c$c.log" | grep -vE "^\s*$|^wrote"
done
