#!/usr/bin/env bash
# What the GPU path is measured by, on an NVIDIA GPU machine without Rust,
# from binaries and modules built and prepared elsewhere (docs/gpu.md):
#
#   tests   the GPU tests (`xla_prepared_prefill cuda::`, KILN_REQUIRE_GPU=1)
#   decode  batch-1 decode of TinyLlama-1.1B's shape at f16 and q4 (IREE's
#           configured products and kiln's own kernel) beside transformers,
#           with the copy bandwidth (scripts/bench_gpu.py)
#   q4      only the two q4 rows of `decode`, twice, without transformers or
#           the copy (not in the default parts: `decode` measures them)
#   server  kiln-server's aggregate tok/s at 1, 8 and 32 slots and
#           concurrency 1, 8 and 32, 64-token answers, then 192-token ones
#           at 1 and 32 (scripts/server_concurrency.sh)
#   8b      batch-1 decode of Llama-3.1-8B's shape at f16 and q4 beside
#           transformers (400 s, most of it writing the 16 GB folder)
#
#   BIN=dir KILN_CACHE_DIR=carried-cache PARTS="tests decode server" scripts/gpu_all.sh
#
# BIN holds xla_prepared_prefill (the test binary), kiln-bench-decode,
# kiln-server and xtask, release builds with `--features cuda,xla-iree`.
# The modules: scripts/prepare_gpu_tests.sh (tests), `kiln-bench-decode
# --prepare --backend iree-cuda --model tinyllama-1.1b --max-context 640
# --precision f16 --precision q4` (decode; for q4, the same with
# `--precision q4 --q4-rows kernel` too), `kiln prepare --backend
# iree-cuda --model DIR --max-context 256` with `--batch-slots` 8, 32 and
# without (server, DIR the folder `kiln-bench-decode --model
# tinyllama-1.1b --write-model DIR` writes), and `kiln-bench-decode --prepare
# --backend iree-cuda --model llama-3.1-8b --precision f16 --precision q4
# --prompt-tokens 128 --max-context 640`, and its q4 with `--q4-rows kernel`
# (8b). A part whose command fails is reported and the next one runs; the
# exit status is the worst.
set -uo pipefail
: "${BIN:?set BIN}" "${KILN_CACHE_DIR:?set KILN_CACHE_DIR}"
export KILN_CACHE_DIR PYTHONUNBUFFERED=1 KILN_REQUIRE_GPU=1
unset KILN_IREE_COMPILE
here=$(cd "$(dirname "$0")" && pwd)
status=0
part() { echo; echo "== $1 ($(date -u +%H:%M:%S))"; }
fail() { echo "!! $1 failed"; status=1; }

nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,clocks.max.mem --format=csv
for p in ${PARTS:-tests decode server 8b}; do
    case $p in
    tests)
        part "GPU tests"
        # One test at a time, each with its own limit: on 2026-12-05 (an
        # H100) the whole set printed nothing for 570 s, which ate the call.
        for t in $("$BIN/xla_prepared_prefill" cuda:: --list 2>/dev/null | sed -n 's/: test$//p'); do
            timeout "${TEST_LIMIT:-150}" "$BIN/xla_prepared_prefill" "$t" --exact --nocapture \
                --test-threads 1 2>&1 | grep -E "^test |worst|result|panicked|skipped|ABORTED"
            rc=${PIPESTATUS[0]}
            [ "$rc" = 0 ] || fail "test $t (exit $rc; 124: over ${TEST_LIMIT:-150} s)"
        done
        ;;
    decode)
        part "batch-1 decode, TinyLlama-1.1B's shape"
        python3 "$here/bench_gpu.py" --kiln-bench "$BIN/kiln-bench-decode" \
            --precision f16 q4 --q4-rows configured kernel --hf-dtype float16 --prompt 16 \
            --decode 256 --repeat 1 ||
            fail decode
        ;;
    q4)
        part "q4 row products, TinyLlama-1.1B's shape"
        model=/tmp/kiln-tinyllama-1.1b
        [ -f "$model/config.json" ] ||
            "$BIN/kiln-bench-decode" --model tinyllama-1.1b --write-model "$model"
        for round in 1 2; do
            echo "round $round"
            "$BIN/kiln-bench-decode" --backend iree-cuda --model "$model" --max-context 640 \
                --prompt-tokens 16 --decode-tokens 256 --precision q4 \
                --q4-rows configured --q4-rows kernel | grep -v '^[][{} ]' || fail q4
        done
        ;;
    server)
        part "kiln-server, TinyLlama-1.1B's shape, f16"
        model=/tmp/kiln-tinyllama-1.1b
        [ -f "$model/config.json" ] ||
            "$BIN/kiln-bench-decode" --model tinyllama-1.1b --write-model "$model"
        python3 "$here/word_tokenizer.py" "$model"
        common=(SERVER="$BIN/kiln-server" LOAD="$BIN/xtask" MODEL_ID=kiln-tinyllama-1.1b
            LOAD_ARGS=--allow-divergence
            SERVER_ARGS="--backend iree-cuda --model $model --max-context 256")
        env "${common[@]}" SLOTS="1 8 32" CONCURRENCY="1 8 32" "$here/server_concurrency.sh" ||
            fail "server (64 tokens)"
        env "${common[@]}" MAX_TOKENS=192 SLOTS="1 32" CONCURRENCY="1 32" \
            "$here/server_concurrency.sh" || fail "server (192 tokens)"
        ;;
    8b)
        part "batch-1 decode, Llama-3.1-8B's shape"
        python3 "$here/bench_gpu.py" --kiln-bench "$BIN/kiln-bench-decode" --preset llama-3.1-8b \
            --precision f16 q4 --q4-rows configured kernel --hf-dtype float16 --prompt 128 \
            --decode 64 --repeat 2 || fail 8b
        ;;
    *) echo "unknown part: $p"; exit 2 ;;
    esac
done
exit $status
