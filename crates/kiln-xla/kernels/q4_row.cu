// kiln's one-row product of 4-bit block weights on NVIDIA GPUs, dispatched
// from the decode modules through `hal.dispatch.extern`
// (crates/kiln-xla/src/q4_kernel.rs). `cargo xtask kernels` compiles it
// to the PTX beside it with clang (no CUDA headers: the few intrinsics are
// clang builtins or inline PTX).
//
//   y[o] = Σ_b Σ_i (q[o,b,i] · scale[o,b] + offset[o,b]) · x[b,i]
//
// with 4-bit q in blocks of 32 inputs (crates/kiln-xla/src/q4.rs: element
// 2k in the low nibble of byte k). The row is taken as the module's CPU
// graph takes it in integers (`q4_integer_row_product` in llama.rs): each
// block of x rounded to 16-bit levels of its largest magnitude, x ≈ step ·
// level, so that
//
//   Σ_i w·x ≈ scale · step · Σ_i q·level + offset · Σ_i x
//
// and Σ q·level is summed in 32-bit integers with `dp2a` (two 16-bit levels
// times two bytes a instruction): no conversion of a 4-bit value to float,
// which at a quarter of the float rate would bound the kernel below the
// memory's.
//
// Layout: a workgroup is WARPS warps; a warp takes ROWS consecutive outputs,
// its lanes the blocks lane, lane + 32, ... of each. A lane rounds its block
// of x once and uses the levels for all ROWS rows, whose 16-byte blocks of
// values it loads side by side (a warp's loads of one row are 512
// consecutive bytes). Bindings: quants (bytes), scales, offsets (f16), x
// (f32), y (f32); constants: outputs, blocks a row, rows a warp.

typedef unsigned int u32;
typedef unsigned short u16;
#define WARPS 8

#ifndef KILN_HOST_CHECK
// Without CUDA's headers, what they would define.
#define __device__ __attribute__((device))
#define __global__ __attribute__((global))
#define __forceinline__ __inline__ __attribute__((always_inline))
typedef unsigned long size_t;
struct __attribute__((aligned(16))) float4 {
    float x, y, z, w;
};
#define GLOBAL extern "C" __global__ __attribute__((launch_bounds(WARPS * 32)))

static __device__ __forceinline__ u32 dp2a_lo(u32 levels, u32 bytes, u32 acc) {
    u32 d;
    asm("dp2a.lo.s32.u32 %0, %1, %2, %3;" : "=r"(d) : "r"(levels), "r"(bytes), "r"(acc));
    return d;
}

static __device__ __forceinline__ u32 dp2a_hi(u32 levels, u32 bytes, u32 acc) {
    u32 d;
    asm("dp2a.hi.s32.u32 %0, %1, %2, %3;" : "=r"(d) : "r"(levels), "r"(bytes), "r"(acc));
    return d;
}

// The low halves of a and b: (a & 0xffff) | (b << 16).
static __device__ __forceinline__ u32 pack_low_halves(u32 a, u32 b) {
    u32 d;
    asm("prmt.b32 %0, %1, %2, 0x5410;" : "=r"(d) : "r"(a), "r"(b));
    return d;
}

static __device__ __forceinline__ float half_to_float(u16 h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

// 16 bytes of values, read once: not kept in L1, where x lives.
static __device__ __forceinline__ void load_values(const u32 *p, u32 v[4]) {
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v[0]), "=r"(v[1]), "=r"(v[2]), "=r"(v[3])
                 : "l"(p));
}
#else
// The host's build for kiln-xla's test of this file's arithmetic
// (`kernels::tests`): the instructions above as PTX defines them.
#include "q4_row_host.h"
#endif

// Adding 1.5 · 2^23 to |t| ≤ 2^22 leaves round-to-nearest-even(t) in the
// low bits, in two's complement: its low 16 bits are the level as an i16.
#define ROUNDING_MAGIC 12582912.0f
#define LEVELS 32767.0f

// One block of x as levels packed for dp2a against a word of values w
// (elements 8j..8j+7, element 8j+2k in the low nibble of byte k): levels[4j]
// pairs elements 8j and 8j+2 (against bytes 0, 1 of the even nibbles),
// [4j+1] 8j+4 and 8j+6 (bytes 2, 3), [4j+2] and [4j+3] the odd ones.
struct Block {
    u32 levels[16];
    float step;     // the f32 value of one level
    float sum;      // Σ x
    int level_sum;  // Σ level, for the values' bias of 8 (below)
};

static __device__ __forceinline__ void round_block(const float *x, Block &block) {
    float v[32];
    const float4 *x4 = (const float4 *)x;
#pragma unroll
    for (int i = 0; i < 8; i++) {
        float4 f = x4[i];
        v[4 * i] = f.x;
        v[4 * i + 1] = f.y;
        v[4 * i + 2] = f.z;
        v[4 * i + 3] = f.w;
    }
    float largest = 0.0f, sum = 0.0f;
#pragma unroll
    for (int i = 0; i < 32; i++) {
        largest = __builtin_fmaxf(largest, __builtin_fabsf(v[i]));
        sum += v[i];
    }
    // A block of zeros: any finite factor gives levels of zero.
    float factor = LEVELS / __builtin_fmaxf(largest, 1e-30f);
    u32 bits[32];
#pragma unroll
    for (int i = 0; i < 32; i++) {
        float t = v[i] * factor;
        bits[i] = __builtin_bit_cast(u32, t + ROUNDING_MAGIC);
    }
    int level_sum = 0;
#pragma unroll
    for (int j = 0; j < 4; j++) {
        const u32 *e = bits + 8 * j;
        block.levels[4 * j] = pack_low_halves(e[0], e[2]);
        block.levels[4 * j + 1] = pack_low_halves(e[4], e[6]);
        block.levels[4 * j + 2] = pack_low_halves(e[1], e[3]);
        block.levels[4 * j + 3] = pack_low_halves(e[5], e[7]);
#pragma unroll
        for (int k = 0; k < 4; k++)
            level_sum = (int)dp2a_lo(block.levels[4 * j + k], 0x0101u, (u32)level_sum);
    }
    block.step = largest * (1.0f / LEVELS);
    block.sum = sum;
    block.level_sum = level_sum;
}

// Σ q·level over one block of values. Each nibble is a signed q in
// two's complement; xor with 8 makes it q + 8 in 0..15, which dp2a takes
// as an unsigned byte, so Σ (q + 8)·level − 8 · Σ level.
static __device__ __forceinline__ int block_dot(const u32 w[4], const Block &block) {
    u32 acc = 0;
#pragma unroll
    for (int j = 0; j < 4; j++) {
        u32 biased = w[j] ^ 0x88888888u;
        u32 even = biased & 0x0f0f0f0fu;
        u32 odd = (biased >> 4) & 0x0f0f0f0fu;
        acc = dp2a_lo(block.levels[4 * j], even, acc);
        acc = dp2a_hi(block.levels[4 * j + 1], even, acc);
        acc = dp2a_lo(block.levels[4 * j + 2], odd, acc);
        acc = dp2a_hi(block.levels[4 * j + 3], odd, acc);
    }
    return (int)acc - 8 * block.level_sum;
}

// Lane `lane`'s share of the ROWS outputs from `first`: its blocks' sums.
template <int ROWS>
static __device__ __forceinline__ void lane_sums(const u32 *quants, const u16 *scales,
                                                 const u16 *offsets, const float *x,
                                                 u32 outputs, u32 blocks, u32 first, u32 lane,
                                                 float acc[ROWS]) {
#pragma unroll
    for (int r = 0; r < ROWS; r++)
        acc[r] = 0.0f;
    for (u32 b = lane; b < blocks; b += 32) {
        u32 w[ROWS][4];
        float scale[ROWS], offset[ROWS];
        // Every row's loads first, so that they are in flight together. A
        // row past the end reads the last one's and is not written.
#pragma unroll
        for (int r = 0; r < ROWS; r++) {
            u32 row = first + r < outputs ? first + r : outputs - 1;
            size_t at = (size_t)row * blocks + b;
            load_values(quants + 4 * at, w[r]);
            scale[r] = half_to_float(scales[at]);
            offset[r] = half_to_float(offsets[at]);
        }
        Block block;
        round_block(x + 32 * b, block);
#pragma unroll
        for (int r = 0; r < ROWS; r++) {
            float dot = (float)block_dot(w[r], block);
            acc[r] += (dot * block.step) * scale[r] + offset[r] * block.sum;
        }
    }
}

#ifndef KILN_HOST_CHECK
template <int ROWS>
static __device__ __forceinline__ void q4_row(const u32 *quants, const u16 *scales,
                                              const u16 *offsets, const float *x, float *y,
                                              u32 outputs, u32 blocks) {
    u32 lane = __nvvm_read_ptx_sreg_tid_x() & 31;
    u32 warp = __nvvm_read_ptx_sreg_tid_x() >> 5;
    u32 first = (__nvvm_read_ptx_sreg_ctaid_x() * WARPS + warp) * ROWS;
    float acc[ROWS];
    lane_sums<ROWS>(quants, scales, offsets, x, outputs, blocks, first, lane, acc);
#pragma unroll
    for (int r = 0; r < ROWS; r++) {
#pragma unroll
        for (int m = 16; m > 0; m >>= 1)
            acc[r] += __nvvm_shfl_sync_bfly_f32(0xffffffffu, acc[r], m, 31);
        if (lane == 0 && first + r < outputs)
            y[first + r] = acc[r];
    }
}

// The one entry point, rows a warp (1, 2 or 4) a constant: IREE gives all
// of a module's dispatches of one object a single executable exporting the
// first dispatch's entry, so entries per row count ran the one-row code
// over a grid made for more rows and left outputs unwritten.
GLOBAL void kiln_q4_row(const u32 *quants, const u16 *scales, const u16 *offsets,
                        const float *x, float *y, u32 outputs, u32 blocks, u32 rows) {
    switch (rows) {
    case 4: q4_row<4>(quants, scales, offsets, x, y, outputs, blocks); break;
    case 2: q4_row<2>(quants, scales, offsets, x, y, outputs, blocks); break;
    default: q4_row<1>(quants, scales, offsets, x, y, outputs, blocks); break;
    }
}
#endif
