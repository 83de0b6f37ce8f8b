#!/usr/bin/env bash
# The test suite under load: both of `cargo xtask test`'s test commands (the
# CPU-only prefix with default features, and `--features cuda,xla-iree`
# against the CUDA prefix), RUNS times (default 3), each with stress-ng
# keeping twice as many busy workers as this machine has cores beside it.
# A test that waits for a time instead of the state it asserts fails here.
# Any failure stops the loop: there is no retry. The tests are built before
# the load starts, so what runs loaded is the tests themselves.
#
#   bash scripts/tests_under_load.sh [RUNS]
set -euo pipefail
cd "$(dirname "$0")/.."
runs="${1:-3}"
command -v stress-ng >/dev/null || {
  echo "needs stress-ng: apt-get install -y stress-ng" >&2
  exit 1
}
export KILN_REQUIRE_MODELS=1
cpu_env="$(cargo xtask env --cpu)"
cuda_env="$(cargo xtask env)"
suite() { # cargo test arguments...
  (eval "$1" && shift && cargo test --workspace --locked "$@")
}
suite "$cpu_env" --no-run
suite "$cuda_env" --features cuda,xla-iree --no-run

workers=$((2 * $(nproc)))
for run in $(seq 1 "$runs"); do
  stress-ng --cpu "$workers" --timeout 0 --quiet &
  stress=$!
  trap 'kill $stress 2>/dev/null' EXIT
  started=$SECONDS
  echo "==> loaded run $run of $runs ($workers stress-ng workers, load $(cut -d' ' -f1-3 /proc/loadavg))"
  suite "$cpu_env" >"target/loaded-run-$run-cpu.log" 2>&1 || {
    echo "loaded run $run: CPU-prefix tests FAILED (target/loaded-run-$run-cpu.log)" >&2
    exit 1
  }
  suite "$cuda_env" --features cuda,xla-iree >"target/loaded-run-$run-cuda.log" 2>&1 || {
    echo "loaded run $run: cuda,xla-iree tests FAILED (target/loaded-run-$run-cuda.log)" >&2
    exit 1
  }
  kill "$stress"
  wait "$stress" 2>/dev/null || true
  echo "<== loaded run $run: every test passed in $((SECONDS - started)) s (load $(cut -d' ' -f1-3 /proc/loadavg))"
done
