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
#           transformers, each engine drawing its own random weights
#           (`bench_gpu.py --random-weights`: until 2026-12-07 both read a
#           16 GB f16 folder written first, 400 s of the part)
#   llamacpp  llama.cpp's CUDA build (scripts/llama_cpp_cuda.sh, built or
#           reused) runs `llama-bench -ngl 99 -p 128 -n 128 -r 3` on the
#           pinned SmolLM2 (Q4_1, $KILN_CACHE_DIR/models) and on 8B-shaped
#           random Q4_0 and Q8_0 files (scripts/write_llama_gguf.py;
#           $Q4_0_GGUF, $Q8_0_GGUF, default /tmp/kiln-llama-8b-q4_0.gguf and
#           -q8_0.gguf, written when missing): prefill (pp) and decode (tg)
#           tok/s; then, where BIN is set, kiln on the same files at each
#           file's own precision (q4, q4, q8: kiln's default for them; prompt
#           128, 128 decoded tokens; modules: `kiln-bench-decode --prepare
#           --backend iree-cuda --model FILE --prompt-tokens 128 --max-context
#           640` for each file, the 8B files' being the `llama-3.1-8b`
#           preset's at `--precision q4` and `--precision q8`).
#           Needs LLAMA_CPP_SRC, the pinned llama-cpp-python sdist or what
#           `llama_cpp_cuda.sh pack` made of it; a default part when that is
#           set.
#
#   BIN=dir KILN_CACHE_DIR=carried-cache PARTS="tests decode server" scripts/gpu_all.sh
#
# BIN holds xla_prepared_prefill (the test binary), kiln-bench-decode,
# kiln-server and kiln-load, release builds with `--features cuda,xla-iree`.
# The modules: scripts/prepare_gpu_tests.sh (tests), `kiln-bench-decode
# --prepare --backend iree-cuda --model tinyllama-1.1b --max-context 640
# --precision f16 --precision q4` (decode; q4's default is kiln's kernel,
# and the same with `--precision q4 --q4-rows configured` too), `kiln prepare --backend
# iree-cuda --model DIR --max-context 256` with `--batch-slots` 8, 32 and
# without (server, DIR the folder `kiln-bench-decode --model
# tinyllama-1.1b --write-model DIR` writes), and `kiln-bench-decode --prepare
# --backend iree-cuda --model llama-3.1-8b --precision f16 --precision q4
# --prompt-tokens 128 --max-context 640`, and its q4 with `--q4-rows
# configured` (8b). A part whose command fails is reported and the next one runs; the
# exit status is the worst.
set -uo pipefail
: "${KILN_CACHE_DIR:?set KILN_CACHE_DIR}"
parts=${PARTS:-tests decode server 8b${LLAMA_CPP_SRC:+ llamacpp}}
for p in $parts; do [ "$p" = llamacpp ] || : "${BIN:?set BIN}"; done
export KILN_CACHE_DIR PYTHONUNBUFFERED=1 KILN_REQUIRE_GPU=1
unset KILN_IREE_COMPILE
here=$(cd "$(dirname "$0")" && pwd)
status=0
part() { echo; echo "== $1 ($(date -u +%H:%M:%S))"; }
fail() { echo "!! $1 failed"; status=1; }

nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,clocks.max.mem --format=csv
for p in $parts; do
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
        common=(SERVER="$BIN/kiln-server" LOAD="$BIN/kiln-load" MODEL_ID=kiln-tinyllama-1.1b
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
            --decode 64 --repeat 2 --random-weights || fail 8b
        ;;
    llamacpp)
        part "llama.cpp's CUDA build: llama-bench, SmolLM2 Q4_1 and Llama-3.1-8B's shape Q4_0"
        log=/tmp/llama-cpp-cuda-build.log
        "$here/llama_cpp_cuda.sh" build "${LLAMA_CPP_SRC:?set LLAMA_CPP_SRC}" >"$log" 2>&1
        rc=$?
        cat "$log"
        [ "$rc" = 0 ] || { fail "llama.cpp build"; continue; }
        bench=$(tail -1 "$log")
        smol="$KILN_CACHE_DIR/models/smollm2-135m-instruct.gguf"
        want=$(python3 -c 'import json, sys
print(json.load(open(sys.argv[1]))["models"]["smollm2-135m-instruct"]["member_sha256"])' \
            "$here/../nix/pins.json")
        [ "$(sha256sum "$smol" 2>/dev/null | cut -d' ' -f1)" = "$want" ] ||
            { fail "$smol is missing or not the pinned file"; smol=; }
        q4_0=${Q4_0_GGUF:-/tmp/kiln-llama-8b-q4_0.gguf}
        [ -f "$q4_0" ] || python3 "$here/write_llama_gguf.py" "$q4_0" ||
            { fail "writing $q4_0"; q4_0=; }
        q8_0=${Q8_0_GGUF:-/tmp/kiln-llama-8b-q8_0.gguf}
        [ -f "$q8_0" ] || python3 "$here/write_llama_gguf.py" --type q8_0 "$q8_0" ||
            { fail "writing $q8_0"; q8_0=; }
        for model in $smol $q4_0 $q8_0; do
            json=/tmp/llama-bench-$(basename "$model" .gguf).json
            "$bench" -m "$model" -ngl 99 -p 128 -n 128 -r 3 -o json >"$json" 2>"${json%.json}.log" ||
                { tail -20 "${json%.json}.log"; fail "llama-bench on $model"; continue; }
            python3 - "$json" <<'EOF' || fail "reading llama-bench's output"
import json, statistics, sys
# The median too: the first timed prompt run is 30-50 % slower than the rest
# (H100, 2026-12-06), which pulls the mean of 3 down.
for r in json.load(open(sys.argv[1])):
    test = "pp%d" % r["n_prompt"] if r["n_prompt"] else "tg%d" % r["n_gen"]
    print("llama.cpp %s on %s: %s (%s) %s median %.1f tok/s, mean %.1f ± %.1f"
          " (flash_attn %s, ngl %s, %d runs)" % (
        r["build_commit"], r["gpu_info"], r["model_filename"].split("/")[-1], r["model_type"],
        test, statistics.median(r["samples_ts"]), r["avg_ts"], r["stddev_ts"], r["flash_attn"],
        r["n_gpu_layers"], len(r["samples_ts"])))
EOF
            # kiln on the very same file, in the same call.
            [ -n "${BIN:-}" ] || continue
            timeout 300 "$BIN/kiln-bench-decode" --backend iree-cuda --model "$model" \
                --max-context 640 --prompt-tokens 128 --decode-tokens 128 |
                grep -v '^[][{} ]' || fail "kiln on $model"
        done
        ;;
    *) echo "unknown part: $p"; exit 2 ;;
    esac
done
exit $status
