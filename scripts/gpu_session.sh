#!/usr/bin/env bash
# The GPU checks and the benchmark on a machine with an NVIDIA GPU and no
# Rust: the binaries and the module cache are built and prepared elsewhere
# (docs/gpu.md says how) and carried here.
#
#   BIN=dir-with-binaries KILN_CACHE_DIR=carried-cache OUT=results scripts/gpu_session.sh
#
# BIN holds kiln, kiln-bench-decode and xla_prepared_prefill (the test
# binary). BENCH_ARGS go to scripts/bench_gpu.py. PROFILE, if set, is a
# ';'-separated list of kiln-bench-decode variant flags to profile two
# decode steps of with Nsight Compute. Logs go to OUT/logs.tgz; the tables
# are printed last.
set -uo pipefail
: "${BIN:?set BIN}" "${KILN_CACHE_DIR:?set KILN_CACHE_DIR}" "${OUT:?set OUT}"
export KILN_CACHE_DIR PYTHONUNBUFFERED=1
unset KILN_IREE_COMPILE
here=$(cd "$(dirname "$0")" && pwd)
logs=$(mktemp -d)
status=0

nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv | tee "$logs/gpu.txt"

if [ -z "${SKIP_TESTS:-}" ]; then
    echo "== GPU tests"
    "$BIN/xla_prepared_prefill" cuda:: --nocapture --test-threads 1 > "$logs/tests.log" 2>&1 || status=1
    grep -E "^test |worst|result|panicked" "$logs/tests.log"
fi

echo "== benchmark"
# shellcheck disable=SC2086
python3 "$here/bench_gpu.py" --kiln-bench "$BIN/kiln-bench-decode" --json "$logs/bench.json" \
    ${BENCH_ARGS:-} 2>&1 | tee "$logs/bench.log" | grep -v '^{' || status=1

i=0
IFS=';' read -ra variants <<< "${PROFILE:-}"
for variant in "${variants[@]}"; do
    i=$((i + 1))
    ncu=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
    # Kernels in one decode step: 299 for tinyllama-1.1b at f16 (for another
    # model, count the `hal.command_buffer.dispatch` calls of its decode module
    # compiled with `--output-format=vm-asm`; `--compile-to=flow` counts one
    # fewer here).
    per_step=${KERNELS_PER_STEP:-299}
    # Skip the warm-up step's kernels; time each kernel of the next two.
    # shellcheck disable=SC2086
    "$ncu" --clock-control none --metrics gpu__time_duration.sum --csv --print-units base \
        -k regex:decode_step --launch-skip "$per_step" --launch-count $((2 * per_step)) \
        "$BIN/kiln-bench-decode" --backend iree-cuda --model /tmp/kiln-tinyllama-1.1b \
        --max-context 640 --prompt-tokens 16 --decode-tokens 4 --repeat 1 $variant \
        > "$logs/ncu-$i.csv" 2> "$logs/ncu-$i.err" || status=1
    {
        echo "== Nsight Compute, two decode steps: $variant"
        python3 "$here/ncu_summary.py" "$logs/ncu-$i.csv" --steps 2 \
            --weight-bytes "$(case $variant in *f32*) echo 4 ;; *) echo 2 ;; esac)"
    } > "$logs/ncu-$i.md" 2>&1 || status=1
done

tar -czf "$OUT/logs.tgz" -C "$logs" .
cat "$logs"/ncu-*.md 2>/dev/null
sed -n '/^copy bandwidth .* decode bound/,$p' "$logs/bench.log"
exit $status
