# Sourced (from the repository root) by the gpu_check scripts that compare two trees on one
# machine: TREES is (head), or (base head) with BASE=<commit>, whose `breakgraph` is exported to a
# temporary folder, or with BASE_TREE=<folder holding a `breakgraph` package> (a copy made
# beforehand, for a machine whose checkout has no git history); `enter_tree NAME` moves into that
# tree's folder and prints which package Python imports there (`python -m` puts the current
# folder first on the path).
ROOT=$PWD
TREES=(head)
if [ -n "${BASE_TREE:-}" ]; then
  BASE_DIR=$(cd "$BASE_TREE" && pwd) && TREES=(base head)
elif [ -n "${BASE:-}" ]; then
  BASE_DIR=$(mktemp -d)
  git archive "$BASE" breakgraph | tar x -C "$BASE_DIR" && TREES=(base head)
fi
enter_tree() {
  if [ "$1" = base ]; then cd "$BASE_DIR"; else cd "$ROOT"; fi
  echo "== $1: $(python -c 'import breakgraph; print(breakgraph.__file__)')"
}
