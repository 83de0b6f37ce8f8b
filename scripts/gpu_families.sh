#!/usr/bin/env bash
# The model families on a GPU machine without Rust (docs/gpu.md): each GPU
# test alone (`xla_prepared_prefill cuda::`, KILN_REQUIRE_GPU=1), then the
# families at their real widths, made there by scripts/make_fixture.py
# (torch and transformers needed), against transformers on `cpu` and
# against `cpu` on `iree-cuda`.
#
#   BIN=dir KILN_CACHE_DIR=carried-cache scripts/gpu_families.sh
#
# BIN holds the release test binaries xla_prepared_prefill and hf_reference
# (`--features cuda,xla-iree`). The modules: scripts/prepare_gpu_tests.sh,
# and for the real widths `kiln-bench-decode --prepare --backend iree-cuda
# --model DIR --max-context 64 --precision f32 --precision f16` for each
# folder `scripts/make_fixture.py DIR-PARENT NAME --config-only` writes.
# SKIP (a grep -E pattern) leaves more GPU tests out.
set -uo pipefail
: "${BIN:?set BIN}" "${KILN_CACHE_DIR:?set KILN_CACHE_DIR}"
export KILN_CACHE_DIR KILN_REQUIRE_GPU=1 PYTHONUNBUFFERED=1
unset KILN_IREE_COMPILE
here=$(cd "$(dirname "$0")" && pwd)
wide=${WIDE:-/tmp/kiln-wide}
names=(qwen2.5-0.5b-wide llama-3.2-1b-wide mistral-7b-wide)
status=0
fail() { echo "!! $1 failed"; status=1; }

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
python3 "$here/make_fixture.py" "$wide" "${names[@]}" > "$wide.log" 2>&1 &
maker=$!
tests=$("$BIN/xla_prepared_prefill" cuda:: --list 2>/dev/null | sed -n 's/: test$//p' |
    grep -v -E "wide_fixtures${SKIP:+|$SKIP}")
for t in $tests; do
    echo "== $t ($(date -u +%T))"
    timeout "${TEST_LIMIT:-150}" "$BIN/xla_prepared_prefill" "$t" --exact --nocapture \
        --test-threads 1 2>&1 | grep -E "^test |worst|result|panicked|skipped|ABORTED|greedy"
    rc=${PIPESTATUS[0]}
    [ "$rc" = 0 ] || fail "test $t (exit $rc; 124: over ${TEST_LIMIT:-150} s)"
done
wait "$maker" || { cat "$wide.log"; fail make_fixture.py; }
echo "== real widths: cpu against transformers ($(date -u +%T))"
KILN_WIDE_FIXTURES=$wide "$BIN/hf_reference" wide_fixtures --nocapture --test-threads 1 2>&1 |
    grep -E "max|result|panicked"
[ "${PIPESTATUS[0]}" = 0 ] || fail "hf_reference wide_fixtures"
echo "== real widths: iree-cuda against cpu ($(date -u +%T))"
KILN_WIDE_FIXTURES=$wide "$BIN/xla_prepared_prefill" cuda::wide_fixtures --nocapture \
    --test-threads 1 2>&1 | grep -E "worst|result|panicked"
[ "${PIPESTATUS[0]}" = 0 ] || fail "cuda::wide_fixtures"
exit $status
