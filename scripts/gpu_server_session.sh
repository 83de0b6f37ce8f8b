#!/usr/bin/env bash
# kiln-server's continuous batching on an NVIDIA GPU against transformers'
# own (`generate_batch`), on the same random weights of TinyLlama-1.1B's shape
# at f16: aggregate decode tok/s at concurrency 1, 8 and 32, kiln at batch 1
# (--batch-slots 1) and batched (--batch-slots 8 and 32), in one run.
#
#   BIN=dir KILN_CACHE_DIR=carried-cache scripts/gpu_server_session.sh
#
# At f16 the load test counts greedy texts that depart from the prompt alone
# (--allow-divergence) instead of failing: batched and batch-1 steps round
# differently on the GPU. LOAD_ARGS= (empty) makes it strict again.
#
# BIN holds kiln-server, kiln-bench-decode and kiln-load (release builds with
# `--features cuda,xla-iree`); the cache holds the modules `kiln prepare
# --backend iree-cuda --model DIR --max-context 256 --batch-slots N` wrote for N = 8 and 32
# (docs/server.md says how). The machine needs no compiler and no network.
set -euo pipefail
: "${BIN:?set BIN}" "${KILN_CACHE_DIR:?set KILN_CACHE_DIR}"
export KILN_CACHE_DIR PYTHONUNBUFFERED=1
unset KILN_IREE_COMPILE
here=$(cd "$(dirname "$0")" && pwd)
model=${MODEL_DIR:-/tmp/kiln-tinyllama-1.1b}
if [ ! -f "$model/config.json" ]; then
    "$BIN/kiln-bench-decode" --model tinyllama-1.1b --write-model "$model"
fi
# Random weights need a tokenizer that names every id: one word per id.
python3 "$here/word_tokenizer.py" "$model"
nvidia-smi --query-gpu=name,driver_version --format=csv
SERVER="$BIN/kiln-server" LOAD="$BIN/kiln-load" MODEL_ID=$(basename "$model") \
    LOAD_ARGS="${LOAD_ARGS---allow-divergence}" \
    SERVER_ARGS="--backend iree-cuda --model $model --max-context 256" \
    SLOTS="${SLOTS:-1 8 32}" CONCURRENCY="1 8 32" "$here/server_concurrency.sh"
python3 "$here/bench_transformers_batch.py" --model "$model" --dtype float16 \
    --concurrency 1 8 32 --max-tokens 64
