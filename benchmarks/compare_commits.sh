#!/usr/bin/env bash
# Run a benchmark against another commit's package, then against this checkout's, one
# after the other on the same machine, and print both results and their ratios.
#
#   benchmarks/compare_commits.sh BASE [benchmark flags...]
#   BENCH=benchmarks/profile_step.py benchmarks/compare_commits.sh BASE --dtype=bfloat16
#
# BASE is checked out in a temporary git worktree; this checkout's benchmark script
# (default benchmarks/bench_throughput.py) runs twice with the same interpreter
# ($PYTHON, default .venv/bin/python), first with PYTHONPATH at BASE's tree so
# `import jaxinfer` is BASE's, then at this checkout's. Results land in $OUT_DIR
# (default a temporary directory): base.json, head.json, ratios.json.
set -euo pipefail
base=${1:?usage: compare_commits.sh BASE [benchmark flags...]}
shift
root=$(git rev-parse --show-toplevel)
py=${PYTHON:-$root/.venv/bin/python}
script=$root/${BENCH:-benchmarks/bench_throughput.py}
out=${OUT_DIR:-$(mktemp -d)}
tree=$(mktemp -d)/base
git -C "$root" worktree add --quiet --detach "$tree" "$base"
trap 'git -C "$root" worktree remove --force "$tree"' EXIT
mkdir -p "$out"
for side in base head; do
  src=$([ "$side" = base ] && echo "$tree" || echo "$root")
  echo "== $side: $(git -C "$src" log -1 --format='%h %s' | cut -c1-80)" >&2
  (cd / && PYTHONPATH=$src "$py" -c 'import jaxinfer, sys; sys.stderr.write(jaxinfer.__file__ + "\n")')
  PYTHONPATH=$src "$py" "$script" "$@" > "$out/$side.json"
done
"$py" "$root/benchmarks/ratios.py" "$out/base.json" "$out/head.json" | tee "$out/ratios.json"
echo "results in $out" >&2
