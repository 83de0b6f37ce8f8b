#!/usr/bin/env bash
# Prepares every CUDA module the GPU tests (`xla_prepared_prefill cuda::`)
# load, on a machine with the pinned compiler and no GPU, into
# KILN_CACHE_DIR, to be carried to a GPU machine with the test binary
# (docs/gpu.md, "The GPU tests"):
#
#   eval "$(cargo xtask env)"
#   cargo build --release --features cuda,xla-iree
#   KILN_CACHE_DIR=target/gpu-cache scripts/prepare_gpu_tests.sh
#
# BIN is where kiln and kiln-bench-decode are (default target/release).
set -euo pipefail
: "${KILN_CACHE_DIR:?set KILN_CACHE_DIR to the cache to carry}"
export KILN_CACHE_DIR
bin=${BIN:-target/release}
cd "$(dirname "$0")/.."
prepare() { "$bin/kiln" prepare --backend iree-cuda --max-context 64 "$@" > /dev/null; }
fixtures=(llama-gqa-untied llama-mqa-tied mistral-gqa-window qwen2-tied-bias)

for precision in f32 f16; do
    # The reference comparisons and the speculative test (multi-token steps).
    prepare --precision "$precision" --draft-tokens 7
    for fixture in "${fixtures[@]}"; do
        prepare --model "tests/fixtures/$fixture" --precision "$precision" --draft-tokens 7
    done
    # The batched modules: four slots, their joint prefill and steps.
    prepare --model tests/fixtures/llama-gqa-untied --precision "$precision" --batch-slots 4
done
# Chained greedy steps.
for steps in 3 4; do
    prepare --model tests/fixtures/llama-gqa-untied --precision f32 --steps-per-call "$steps"
done
# 4-bit: the embedded model, and random-100m (the device's argmax over a
# 32,000-token vocabulary, the q4 kernel configuration) at every precision.
# q4's products as IREE's configured code (--q4-rows configured), then
# through kiln's own CUDA kernel (the default), on both models.
prepare --precision q4 --q4-rows configured
"$bin/kiln-bench-decode" --prepare --backend iree-cuda --model random-100m --max-context 64 \
    --precision f32 --precision f16 > /dev/null
"$bin/kiln-bench-decode" --prepare --backend iree-cuda --model random-100m --max-context 64 \
    --precision q4 --q4-rows configured > /dev/null
prepare --precision q4 --q4-rows kernel
"$bin/kiln-bench-decode" --prepare --backend iree-cuda --model random-100m --max-context 64 \
    --precision q4 --q4-rows kernel > /dev/null
# 8-bit blocks (GGUF's Q8_0), on both models.
prepare --precision q8
"$bin/kiln-bench-decode" --prepare --backend iree-cuda --model random-100m --max-context 64 \
    --precision q8 > /dev/null
# Decode attention through kiln's kernels, whichever is CUDA's default.
"$bin/kiln-bench-decode" --prepare --backend iree-cuda --model random-100m --max-context 64 \
    --precision f16 --precision q4 --decode-attention kernel > /dev/null
echo "prepared into $KILN_CACHE_DIR"
