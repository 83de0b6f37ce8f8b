// What kiln's CUDA benchmark scripts (scripts/*_bench.cu) do with a failed
// driver or runtime call: say which and why, and exit.
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>

static void check(CUresult result, const char* what) {
  if (result != CUDA_SUCCESS) {
    const char* text = nullptr;
    cuGetErrorString(result, &text);
    std::fprintf(stderr, "%s failed: %s\n", what, text ? text : "?");
    std::exit(1);
  }
}

static void check(cudaError_t result, const char* what) {
  if (result != cudaSuccess) {
    std::fprintf(stderr, "%s failed: %s\n", what, cudaGetErrorString(result));
    std::exit(1);
  }
}
