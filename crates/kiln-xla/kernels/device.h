// What CUDA's headers would define, for kiln's kernels that `cargo xtask
// kernels` compiles with clang without them (`-nocudainc`): qualifiers,
// the thread's coordinates, barriers, shuffles and the few conversions.
// With KILN_HOST_CHECK, the same names for the host (device_host.h), where
// kiln-xla's tests run the kernels' arithmetic.

#pragma once

typedef unsigned int u32;
typedef unsigned short u16;
typedef unsigned long long u64;

struct __attribute__((aligned(16))) float4 {
    float x, y, z, w;
};

#ifdef KILN_HOST_CHECK
#include "device_host.h"
#else
#define __device__ __attribute__((device))
#define __global__ __attribute__((global))
#define __forceinline__ __inline__ __attribute__((always_inline))
#define SHARED __attribute__((shared))
// A kernel's entry point, launched with `threads` threads a workgroup.
#define KERNEL(threads) extern "C" __global__ __attribute__((launch_bounds(threads)))

static __device__ __forceinline__ u32 thread_index() { return __nvvm_read_ptx_sreg_tid_x(); }
static __device__ __forceinline__ u32 workgroup_index() { return __nvvm_read_ptx_sreg_ctaid_x(); }

static __device__ __forceinline__ void workgroup_barrier() {
    asm volatile("bar.sync 0;" ::: "memory");
}

// The value of lane `lane ^ mask` of the warp.
static __device__ __forceinline__ float shuffle_xor(float v, int mask) {
    return __nvvm_shfl_sync_bfly_f32(0xffffffffu, v, mask, 31);
}

// 2^x (the GPU's own instruction; 2^-inf is 0).
static __device__ __forceinline__ float exp2(float x) {
    float y;
    asm("ex2.approx.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

static __device__ __forceinline__ float half_to_float(u16 h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

// To the nearest f16, ties to even.
static __device__ __forceinline__ u16 float_to_half(float f) {
    u16 h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}
#endif

static __device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int m = 16; m > 0; m >>= 1)
        v = __builtin_fmaxf(v, shuffle_xor(v, m));
    return v;
}

static __device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int m = 16; m > 0; m >>= 1)
        v += shuffle_xor(v, m);
    return v;
}

struct __attribute__((aligned(16))) Words {
    u32 w[4];
};

// The two f16 halves of a word as f32, low half first.
static __device__ __forceinline__ void halves_to_floats(u32 w, float &lo, float &hi) {
    u16 l = (u16)w, h = (u16)(w >> 16);
    lo = half_to_float(l);
    hi = half_to_float(h);
}

// Element i of an output of f32 values, or of f16 ones where `half` (the
// attention kernels write f16 where the product after them takes f16 rows).
static __device__ __forceinline__ void store_float_or_half(float *out, u64 i, float v, u32 half) {
    if (half)
        ((u16 *)out)[i] = float_to_half(v);
    else
        out[i] = v;
}

// Eight f16 values, as loaded, as f32.
static __device__ __forceinline__ void words_to_floats(const Words &w, float v[8]) {
#pragma unroll
    for (int i = 0; i < 4; i++)
        halves_to_floats(w.w[i], v[2 * i], v[2 * i + 1]);
}
