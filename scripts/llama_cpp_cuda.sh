#!/usr/bin/env bash
# llama.cpp's CUDA build, for comparing kiln with it on the GPU machine
# (docs/gpu.md, "llama.cpp's CUDA build"): only `llama-bench`, sm_90 (H100,
# H200) only, from the vendor/llama.cpp of the llama-cpp-python 0.3.36 sdist
# that scripts/requirements-llama-cpp.txt pins.
#
#   scripts/llama_cpp_cuda.sh pack SDIST OUT.tar.xz
#       where pip works: checks SDIST's sha256 against the pin, then packs its
#       vendor/llama.cpp without what a build never reads (the vocabulary
#       test files under models/, docs/, media/, tests/, gguf-py/ and the
#       like): about 9 MB instead of the sdist's 77 MB, which is more than a
#       GPU machine call carries. Get SDIST with
#       `pip download --no-deps --no-binary :all: llama-cpp-python==0.3.36`.
#   scripts/llama_cpp_cuda.sh build SRC
#       on the GPU machine (CUDA toolkit, CMake; no network): SRC is the sdist
#       (its sha256 checked against the pin first) or a tarball `pack` wrote.
#       Either way the unpacked sources are checked against SOURCE_SHA256
#       below (the sha256 of the sorted `sha256sum` listing of every file,
#       made from the pinned sdist) before anything is built. Builds in
#       $LLAMA_CPP_DIR (default /tmp/llama-cpp-cuda), reused when a build of
#       the same sources and flags is there; prints the path of llama-bench
#       on its last line.
#
# The build: CMake, Ninja where there is one, GGML_CUDA=ON,
# CMAKE_CUDA_ARCHITECTURES=90, GGML_NATIVE left at its default (ON: the CPU
# parts for the build machine's CPU), GGML_CUDA_FA_ALL_QUANTS left off (the
# default: flash attention for f16/q8_0/q4_0 caches only), no curl, OpenSSL,
# NCCL, tests, examples or server; `cmake --build --target llama-bench -j16`.
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
SDIST_NAME=llama_cpp_python-0.3.36
# The sha256 of `sources_digest` over the packed tree, from the pinned sdist.
SOURCE_SHA256=4d314bbe365d825dad10b808199bf9d1fe4f128562c73d87dd4bd40c7bfea741
# What `pack` leaves out, relative to vendor/llama.cpp (none is read by the build).
EXCLUDES=(./.git ./.github ./.devops ./docs ./media ./models ./gguf-py ./tests ./benches
    ./examples ./pocs ./ci ./skills ./requirements ./conversion)
CMAKE_FLAGS=(-DCMAKE_BUILD_TYPE=Release -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90
    -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DGGML_CUDA_NCCL=OFF -DLLAMA_BUILD_TESTS=OFF
    -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF)

die() { echo "llama_cpp_cuda.sh: $*" >&2; exit 1; }

# The sdist's sha256, read from the pin file (the line after its name).
pinned_sdist_sha256() {
    awk '/^llama-cpp-python==0\.3\.36/ { getline; sub(/.*sha256:/, ""); print $1; exit }' \
        "$here/requirements-llama-cpp.txt"
}

check_sdist() {
    local want got
    want=$(pinned_sdist_sha256)
    [ ${#want} = 64 ] || die "no sha256 for llama-cpp-python==0.3.36 in requirements-llama-cpp.txt"
    got=$(sha256sum "$1" | cut -d' ' -f1)
    [ "$got" = "$want" ] || die "$1 has sha256 $got, the pin says $want"
}

# sha256 over the sorted per-file sha256 listing of a tree (contents and paths).
sources_digest() {
    (cd "$1" && find . -type f -print0 | LC_ALL=C sort -z | xargs -0 sha256sum) |
        sha256sum | cut -d' ' -f1
}

# Unpacks the sdist's vendor/llama.cpp, less EXCLUDES, into $2.
unpack_sdist() {
    local sdist=$1 into=$2 excludes=() e
    for e in "${EXCLUDES[@]}"; do excludes+=("--exclude=$SDIST_NAME/vendor/llama.cpp/${e#./}"); done
    mkdir -p "$into"
    tar -xzf "$sdist" -C "$into" --strip-components=3 "${excludes[@]}" \
        "$SDIST_NAME/vendor/llama.cpp"
}

pack() {
    local sdist=${1:?pack SDIST OUT.tar.xz} out=${2:?pack SDIST OUT.tar.xz} tmp digest
    check_sdist "$sdist"
    tmp=$(mktemp -d)
    trap 'rm -rf "$tmp"' RETURN
    unpack_sdist "$sdist" "$tmp/llama.cpp"
    digest=$(sources_digest "$tmp/llama.cpp")
    if [ "$SOURCE_SHA256" != "$digest" ]; then
        echo "sources digest $digest (SOURCE_SHA256 in this script: $SOURCE_SHA256)" >&2
        [[ $SOURCE_SHA256 == __* ]] || die "the packed sources differ from the pinned ones"
    fi
    tar -C "$tmp" --sort=name --owner=0 --group=0 --numeric-owner --mtime=@0 -cf - llama.cpp |
        xz -6 -T1 >"$out"
    echo "packed $(du -h "$out" | cut -f1) into $out (sources $digest)"
}

build() {
    local src=${1:?build SRC (the sdist or a packed tarball)}
    local dir=${LLAMA_CPP_DIR:-/tmp/llama-cpp-cuda} stamp started cmake gen=()
    stamp="$SOURCE_SHA256 ${CMAKE_FLAGS[*]}"
    if [ -x "$dir/build/bin/llama-bench" ] && [ "$(cat "$dir/stamp" 2>/dev/null)" = "$stamp" ]; then
        echo "reusing the build in $dir"
        echo "$dir/build/bin/llama-bench"
        return
    fi
    rm -rf "$dir"
    mkdir -p "$dir"
    case $src in
    *.tar.gz) check_sdist "$src"; unpack_sdist "$src" "$dir/src" ;;
    *.tar.xz)
        mkdir -p "$dir/src"
        if command -v xz >/dev/null; then
            tar -xJf "$src" -C "$dir/src" --strip-components=1
        else
            python3 -c 'import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.argv[1]), sys.stdout.buffer)' \
                "$src" | tar -xf - -C "$dir/src" --strip-components=1
        fi
        ;;
    *) die "$src: expected the sdist (.tar.gz) or a packed .tar.xz" ;;
    esac
    local digest
    digest=$(sources_digest "$dir/src")
    [ "$digest" = "$SOURCE_SHA256" ] ||
        die "the sources in $src have digest $digest, expected $SOURCE_SHA256"
    echo "sources verified ($digest)"

    [ -d /usr/local/cuda/bin ] && export PATH="/usr/local/cuda/bin:$PATH"
    command -v nvcc >/dev/null || die "no nvcc on PATH"
    cmake=$(command -v cmake || true)
    [ -n "$cmake" ] || cmake=$(dirname "$(command -v python3)")/cmake
    [ -x "$cmake" ] || die "no cmake"
    command -v ninja >/dev/null && gen=(-G Ninja)
    echo "cmake: $("$cmake" --version | head -1); nvcc: $(nvcc --version | tail -1);" \
        "generator: ${gen[*]:-make}"
    started=$(date +%s)
    # cmake/build-info.cmake asks git for a commit: GIT_DIR keeps it from
    # finding whatever repository the build folder happens to lie in.
    if ! GIT_DIR=/nonexistent "$cmake" -S "$dir/src" -B "$dir/build" "${gen[@]}" \
        "${CMAKE_FLAGS[@]}" >"$dir/configure.log" 2>&1; then
        tail -40 "$dir/configure.log"
        die "configure failed (log: $dir/configure.log)"
    fi
    if ! "$cmake" --build "$dir/build" --target llama-bench -j16 >"$dir/build.log" 2>&1; then
        grep -E -m 20 "error|Error" "$dir/build.log" || true
        tail -20 "$dir/build.log"
        die "build failed (log: $dir/build.log)"
    fi
    echo "built llama-bench in $(($(date +%s) - started)) s (configure and build)"
    echo "$stamp" >"$dir/stamp"
    echo "$dir/build/bin/llama-bench"
}

case ${1:-} in
pack) shift; pack "$@" ;;
build) shift; build "$@" ;;
*) sed -n '2,/^set -euo/p' "$0" | sed '$d'; exit 2 ;;
esac
