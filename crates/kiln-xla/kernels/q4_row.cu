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
// its lanes the blocks lane, lane + 32, ... of each. The workgroup first
// rounds the whole row of x into shared memory, four threads a block, while
// each lane's first blocks of values are already on their way from memory;
// the lanes then read the levels from there and fetch their next blocks of
// values before working on the current ones, so that a lane has loads in
// flight while it computes. Rows of more than SHARED_BLOCKS blocks (wider
// than any model kiln ships a shape for) round per lane instead, each lane
// its own blocks once for all the warp's ROWS rows. A warp's loads of one
// row are 512 consecutive bytes. Bindings: quants (bytes), scales, offsets
// (f16), x (f32), the norm's weight (f16), a residual row (f32), y (f32);
// constants: outputs, blocks a row, rows a warp, an RMSNorm's eps (f32
// bits; 0 for none, and the norm's weight is then not read) and flags.
// With an eps, the product is that of the normalised row, x times the
// norm's weight as it is rounded and the outputs scaled by
// 1 / sqrt(mean(x²) + eps) from the squares the rounding sums anyway, so
// that the matrix keeps the blocks it was given. The flags take in the
// small kernels a decode layer would otherwise run around the products
// (each a launch of a few µs, more than a small product's own time):
// INPUT_SWIGLU reads x as an MLP's gate and up halves, twice the row's
// width, and takes the row SiLU(gate) · up; OUTPUT_RESIDUAL adds the
// residual row to the outputs; OUTPUT_SWIGLU takes the rows in pairs, an
// MLP's gate row and its up row (the matrix stored so: kiln-xla's
// `GraphOptions::pairs_mlp_rows`), and writes SiLU(gate) · up, one output
// a pair, so that the down product after it reads the hidden row itself
// instead of every workgroup of it combining both halves again (on an
// H100 that cost Llama-3.1-8B's down product 22.7 µs against 17.7).

typedef unsigned int u32;
typedef unsigned short u16;
// q8_row.cu builds this file for 8-bit blocks (Q8_ROW): 32 signed bytes a
// block, no offsets. WORDS is a block's 32-bit words of values.
#ifdef Q8_ROW
#define WORDS 8
#define ENTRY kiln_q8_row
#else
#define WORDS 4
#define ENTRY kiln_q4_row
#endif
// WARPS, IN_FLIGHT and MIN_WORKGROUPS_AN_SM may be set from the command line
// to build variants for scripts/q4_kernel_bench.cu; kernels.rs launches the
// defaults.
#ifndef WARPS
#define WARPS 8
#endif
// Blocks of x the workgroup rounds into shared memory: Llama-3.1-8B's down
// product (14,336 inputs) is the widest kiln's presets have. 80 bytes a
// block, 35,840 in all (static shared memory stops at 48 KiB).
#define SHARED_BLOCKS 448
// 16-byte loads of values a lane has in flight in the shared-row path: ROWS
// rows times IN_FLIGHT / ROWS blocks, while it works on as many before them.
#ifndef IN_FLIGHT
#define IN_FLIGHT 4
#endif

// The flags (the last constant).
#define INPUT_SWIGLU 1u
#define OUTPUT_RESIDUAL 2u
#define OUTPUT_SWIGLU 4u

#ifndef KILN_HOST_CHECK
// Without CUDA's headers, what they would define.
#define __device__ __attribute__((device))
#define __global__ __attribute__((global))
#define __forceinline__ __inline__ __attribute__((always_inline))
typedef unsigned long size_t;
struct __attribute__((aligned(16))) float4 {
    float x, y, z, w;
};
#ifdef MIN_WORKGROUPS_AN_SM
#define GLOBAL \
    extern "C" __global__ __attribute__((launch_bounds(WARPS * 32, MIN_WORKGROUPS_AN_SM)))
#else
#define GLOBAL extern "C" __global__ __attribute__((launch_bounds(WARPS * 32)))
#endif
#define SHARED __attribute__((shared))

static __device__ __forceinline__ void workgroup_barrier() {
    asm volatile("bar.sync 0;" ::: "memory");
}

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

// The same with the bytes signed (8-bit values).
static __device__ __forceinline__ u32 dp2a_lo_signed(u32 levels, u32 bytes, u32 acc) {
    u32 d;
    asm("dp2a.lo.s32.s32 %0, %1, %2, %3;" : "=r"(d) : "r"(levels), "r"(bytes), "r"(acc));
    return d;
}

static __device__ __forceinline__ u32 dp2a_hi_signed(u32 levels, u32 bytes, u32 acc) {
    u32 d;
    asm("dp2a.hi.s32.s32 %0, %1, %2, %3;" : "=r"(d) : "r"(levels), "r"(bytes), "r"(acc));
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

// 2^x (the GPU's own instruction; 2^-inf is 0, 2^inf is inf).
static __device__ __forceinline__ float exp2(float x) {
    float y;
    asm("ex2.approx.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
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

// Four words, read or written with one 16-byte access.
struct __attribute__((aligned(16))) Words {
    u32 w[4];
};

// Adding 1.5 · 2^23 to |t| ≤ 2^22 leaves round-to-nearest-even(t) in the
// low bits, in two's complement: its low 16 bits are the level as an i16.
#define ROUNDING_MAGIC 12582912.0f
#define LEVELS 32767.0f

// One block of x as levels packed for dp2a against a word of values w
// (elements 8j..8j+7, element 8j+2k in the low nibble of byte k): levels[4j]
// pairs elements 8j and 8j+2 (against bytes 0, 1 of the even nibbles),
// [4j+1] 8j+4 and 8j+6 (bytes 2, 3), [4j+2] and [4j+3] the odd ones. At
// 8 bits a word holds elements 4j..4j+3 as bytes, and levels[2j] pairs
// elements 4j and 4j+1 (bytes 0, 1), [2j+1] 4j+2 and 4j+3.
struct Block {
    u32 levels[16];
    float step;     // the f32 value of one level
    float sum;      // Σ x
    int level_sum;  // Σ level, for the values' bias of 8 (below)
    float squares;  // Σ x², for the RMSNorm the product may apply
};

// A quarter of a block of x, elements 8g..8g+7 of it: the workgroup rounds
// a block with four threads, each a quarter.
struct Quarter {
    float v[8];
    float largest;  // of the magnitudes
    float sum;
    float squares;
};

// Eight consecutive values of x, as loaded.
static __device__ __forceinline__ void load_eight(const float *x, float v[8]) {
    const float4 *x4 = (const float4 *)x;
    float4 a = x4[0], b = x4[1];
    v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w;
    v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
}

// SiLU(g) = g / (1 + e^-g); e^-g is 2^(-g · log2 e), which overflows to
// inf for very negative g and gives −0, as the limit does.
static __device__ __forceinline__ float silu(float g) {
    return g / (1.0f + exp2(g * -1.44269504088896340736f));
}

// Eight consecutive values of the row from `x`: as they are, or where `up`
// (the gate half's width, 0 for none) is set, SiLU(x) · x[up ..], the MLP's
// gate and up halves combined (INPUT_SWIGLU).
static __device__ __forceinline__ void load_input(const float *x, u32 up, float v[8]) {
    load_eight(x, v);
    if (up) {
        float u[8];
        load_eight(x + up, u);
#pragma unroll
        for (int i = 0; i < 8; i++)
            v[i] = silu(v[i]) * u[i];
    }
}

// A quarter of x as the product takes it: its squares summed as they are
// (for the norm), its values times the norm's eight weights `weight`
// (f16) where there is a norm.
static __device__ __forceinline__ void summarize_quarter(const float x[8], const Words *weight,
                                                         Quarter &q) {
    q.largest = 0.0f;
    q.sum = 0.0f;
    q.squares = 0.0f;
#pragma unroll
    for (int i = 0; i < 8; i++) {
        q.squares += x[i] * x[i];
        float v = x[i];
        if (weight)
            v *= half_to_float((u16)(weight->w[i / 2] >> (16 * (i % 2))));
        q.v[i] = v;
        q.largest = __builtin_fmaxf(q.largest, __builtin_fabsf(v));
        q.sum += v;
    }
}

static __device__ __forceinline__ void load_quarter(const float *x, u32 up, const u16 *weight,
                                                    Quarter &q) {
    float v[8];
    load_input(x, up, v);
    Words w;
    if (weight)
        w = *(const Words *)weight;
    summarize_quarter(v, weight ? &w : nullptr, q);
}

// A block of zeros: any finite factor gives levels of zero.
static __device__ __forceinline__ float level_factor(float largest) {
    return LEVELS / __builtin_fmaxf(largest, 1e-30f);
}

// A quarter's four words of levels (Block::levels[4g..4g+3]) and their Σ.
static __device__ __forceinline__ int quarter_levels(const Quarter &q, float factor,
                                                     u32 levels[4]) {
    u32 e[8];
#pragma unroll
    for (int i = 0; i < 8; i++)
        e[i] = __builtin_bit_cast(u32, q.v[i] * factor + ROUNDING_MAGIC);
#ifdef Q8_ROW
    levels[0] = pack_low_halves(e[0], e[1]);
    levels[1] = pack_low_halves(e[2], e[3]);
    levels[2] = pack_low_halves(e[4], e[5]);
    levels[3] = pack_low_halves(e[6], e[7]);
#else
    levels[0] = pack_low_halves(e[0], e[2]);
    levels[1] = pack_low_halves(e[4], e[6]);
    levels[2] = pack_low_halves(e[1], e[3]);
    levels[3] = pack_low_halves(e[5], e[7]);
#endif
    int level_sum = 0;
#pragma unroll
    for (int k = 0; k < 4; k++)
        level_sum = (int)dp2a_lo(levels[k], 0x0101u, (u32)level_sum);
    return level_sum;
}

// One block rounded by one thread, its quarters combined in the order the
// workgroup's shuffles combine them.
static __device__ __forceinline__ void round_block(const float *x, u32 up, const u16 *weight,
                                                   Block &block) {
    Quarter q[4];
#pragma unroll
    for (int g = 0; g < 4; g++)
        load_quarter(x + 8 * g, up, weight ? weight + 8 * g : nullptr, q[g]);
    float largest = __builtin_fmaxf(__builtin_fmaxf(q[0].largest, q[1].largest),
                                    __builtin_fmaxf(q[2].largest, q[3].largest));
    float factor = level_factor(largest);
    int level_sum = 0;
#pragma unroll
    for (int g = 0; g < 4; g++)
        level_sum += quarter_levels(q[g], factor, block.levels + 4 * g);
    block.step = largest * (1.0f / LEVELS);
    block.sum = (q[0].sum + q[1].sum) + (q[2].sum + q[3].sum);
    block.squares = (q[0].squares + q[1].squares) + (q[2].squares + q[3].squares);
    block.level_sum = level_sum;
}

// Σ q·level over one block of values. Each nibble is a signed q in
// two's complement; xor with 8 makes it q + 8 in 0..15, which dp2a takes
// as an unsigned byte, so Σ (q + 8)·level − 8 · Σ level. At 8 bits, dp2a
// takes the signed bytes as they are.
static __device__ __forceinline__ int block_dot(const u32 w[WORDS], const Block &block) {
    u32 acc = 0;
#ifdef Q8_ROW
#pragma unroll
    for (int j = 0; j < 8; j++) {
        acc = dp2a_lo_signed(block.levels[2 * j], w[j], acc);
        acc = dp2a_hi_signed(block.levels[2 * j + 1], w[j], acc);
    }
    return (int)acc;
#else
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
#endif
}

// One block of values of each of a warp's ROWS rows, with its scales and
// offsets as loaded (f16): they are widened where they are used, so that a
// load's first use is the block's product and the loads of the next blocks
// stay in flight while a lane works on these. A row past the end reads the
// last one's and is not written. (8-bit blocks have no offsets.)
template <int ROWS>
struct Values {
    u32 w[ROWS][WORDS];
    u16 scale[ROWS];
#ifndef Q8_ROW
    u16 offset[ROWS];
#endif
};

template <int ROWS>
static __device__ __forceinline__ void load_block(const u32 *quants, const u16 *scales,
                                                  const u16 *offsets, u32 outputs, u32 blocks,
                                                  u32 first, u32 b, Values<ROWS> &v) {
#pragma unroll
    for (int r = 0; r < ROWS; r++) {
        u32 row = first + r < outputs ? first + r : outputs - 1;
        // In 32 bits (a matrix has fewer than 2^32 blocks: kernels.rs
        // asserts it), so that an address is one multiply-add from it.
        u32 at = row * blocks + b;
        load_values(quants + WORDS * (size_t)at, v.w[r]);
#ifdef Q8_ROW
        load_values(quants + WORDS * (size_t)at + 4, v.w[r] + 4);
        v.scale[r] = scales[at];
#else
        v.scale[r] = scales[at];
        v.offset[r] = offsets[at];
#endif
    }
}

// The values of blocks b, b + 32, ... (IN_FLIGHT / ROWS of them, those
// before `blocks`) of each row.
template <int ROWS>
static __device__ __forceinline__ void load_group(const u32 *quants, const u16 *scales,
                                                  const u16 *offsets, u32 outputs, u32 blocks,
                                                  u32 first, u32 b, Values<ROWS> group[]) {
#pragma unroll
    for (u32 k = 0; k < IN_FLIGHT / ROWS; k++)
        if (b + 32 * k < blocks)
            load_block<ROWS>(quants, scales, offsets, outputs, blocks, first, b + 32 * k,
                             group[k]);
}

template <int ROWS>
static __device__ __forceinline__ void add_block(const Values<ROWS> &v, const Block &block,
                                                 float acc[ROWS]) {
#pragma unroll
    for (int r = 0; r < ROWS; r++) {
        float dot = (float)block_dot(v.w[r], block);
#ifdef Q8_ROW
        acc[r] += (dot * block.step) * half_to_float(v.scale[r]);
#else
        acc[r] += (dot * block.step) * half_to_float(v.scale[r]) +
                  half_to_float(v.offset[r]) * block.sum;
#endif
    }
}

// One block of x in shared memory, 80 bytes: its levels as Block has them,
// then step, Σ x, Σ level and Σ x². A lane reads it with five 16-byte loads; 80
// bytes apart, the eight lanes of a quarter-warp that one load serves hit
// eight different quads of banks (80 · k mod 128 = 16 · (5k mod 8)).
struct SharedBlock {
    Words words[5];
};

// The row of x as levels, rounded once by the workgroup.
struct SharedRow {
    SharedBlock blocks[SHARED_BLOCKS];
};

static __device__ __forceinline__ Words block_tail(float step, float sum, int level_sum,
                                                   float squares) {
    Words t = {{__builtin_bit_cast(u32, step), __builtin_bit_cast(u32, sum), (u32)level_sum,
                __builtin_bit_cast(u32, squares)}};
    return t;
}

#ifndef KILN_HOST_CHECK
// Thread `thread` of `threads`' share of rounding the row: four threads a
// block, each a quarter, their largest magnitudes and sums combined with
// shuffles, so that a block takes a quarter of one thread's time.
static __device__ __forceinline__ void round_row(const float *x, u32 up, const u16 *weight,
                                                 u32 blocks, u32 thread, u32 threads,
                                                 SharedRow &row) {
    // Quarter i is x[8i..8i+8]. Each pass loads the next pass's quarter
    // (and its weights) before it works on its own, so that a wide row's
    // passes do not each wait for a load from L2.
    u32 quarters = 4 * blocks;
    float ahead[8] = {};
    Words ahead_weight = {};
    if (thread < quarters) {
        load_input(x + 8 * thread, up, ahead);
        if (weight)
            ahead_weight = *(const Words *)(weight + 8 * thread);
    }
    // Every thread runs every pass: the shuffles need the whole warp.
    for (u32 base = 0; base < quarters; base += threads) {
        u32 i = base + thread, b = i / 4, g = i % 4;
        bool active = i < quarters;
        float v[8];
#pragma unroll
        for (int k = 0; k < 8; k++)
            v[k] = ahead[k];
        Words w = ahead_weight;
        if (i + threads < quarters) {
            load_input(x + 8 * (i + threads), up, ahead);
            if (weight)
                ahead_weight = *(const Words *)(weight + 8 * (i + threads));
        }
        Quarter q = {};
        if (active)
            summarize_quarter(v, weight ? &w : nullptr, q);
        float largest = q.largest, sum = q.sum, squares = q.squares;
        largest = __builtin_fmaxf(largest, __nvvm_shfl_sync_bfly_f32(0xffffffffu, largest, 1, 31));
        largest = __builtin_fmaxf(largest, __nvvm_shfl_sync_bfly_f32(0xffffffffu, largest, 2, 31));
        sum += __nvvm_shfl_sync_bfly_f32(0xffffffffu, sum, 1, 31);
        sum += __nvvm_shfl_sync_bfly_f32(0xffffffffu, sum, 2, 31);
        squares += __nvvm_shfl_sync_bfly_f32(0xffffffffu, squares, 1, 31);
        squares += __nvvm_shfl_sync_bfly_f32(0xffffffffu, squares, 2, 31);
        Words levels;
        int level_sum = quarter_levels(q, level_factor(largest), levels.w);
        level_sum += __nvvm_shfl_sync_bfly_i32(0xffffffffu, level_sum, 1, 31);
        level_sum += __nvvm_shfl_sync_bfly_i32(0xffffffffu, level_sum, 2, 31);
        if (active) {
            row.blocks[b].words[g] = levels;
            if (g == 0)
                row.blocks[b].words[4] =
                    block_tail(largest * (1.0f / LEVELS), sum, level_sum, squares);
        }
    }
}
#else
// The host rounds block by block: the same arithmetic in the same order.
static void round_row(const float *x, u32 up, const u16 *weight, u32 blocks, u32 thread,
                      u32 threads, SharedRow &row) {
    for (u32 b = thread; b < blocks; b += threads) {
        Block block;
        round_block(x + 32 * b, up, weight ? weight + 32 * b : nullptr, block);
        for (int j = 0; j < 16; j++)
            row.blocks[b].words[j / 4].w[j % 4] = block.levels[j];
        row.blocks[b].words[4] =
            block_tail(block.step, block.sum, block.level_sum, block.squares);
    }
}
#endif

// One for the whole kernel, whichever ROWS the dispatch takes.
static SHARED SharedRow shared_row;

static __device__ __forceinline__ void shared_block(const SharedRow &row, u32 b, Block &block) {
#pragma unroll
    for (int k = 0; k < 4; k++) {
        Words words = row.blocks[b].words[k];
#pragma unroll
        for (int j = 0; j < 4; j++)
            block.levels[4 * k + j] = words.w[j];
    }
    Words tail = row.blocks[b].words[4];
    block.step = __builtin_bit_cast(float, tail.w[0]);
    block.sum = __builtin_bit_cast(float, tail.w[1]);
    block.level_sum = (int)tail.w[2];
    block.squares = __builtin_bit_cast(float, tail.w[3]);
}

// Lane `lane`'s share of the ROWS outputs from `first` with the row in
// shared memory, GROUP blocks at a time (blocks b, b + 32, ...): IN_FLIGHT
// 16-byte loads a lane. `group` holds its first group's values (from block
// `lane`), loaded before the row was rounded; each group's loads go out
// before the group before it is worked on.
template <int ROWS>
static __device__ __forceinline__ void lane_sums_shared(const u32 *quants, const u16 *scales,
                                                        const u16 *offsets, const SharedRow &row,
                                                        u32 outputs, u32 blocks, u32 first,
                                                        u32 lane, Values<ROWS> group[],
                                                        float acc[ROWS], float &squares) {
    static_assert(IN_FLIGHT >= ROWS && IN_FLIGHT % ROWS == 0, "whole blocks of every row");
    const u32 GROUP = IN_FLIGHT / ROWS;
#pragma unroll
    for (int r = 0; r < ROWS; r++)
        acc[r] = 0.0f;
    squares = 0.0f;
    for (u32 b = lane; b < blocks; b += 32 * GROUP) {
        Values<ROWS> next[IN_FLIGHT / ROWS];
        load_group<ROWS>(quants, scales, offsets, outputs, blocks, first, b + 32 * GROUP, next);
#pragma unroll
        for (u32 k = 0; k < GROUP; k++) {
            if (b + 32 * k < blocks) {
                Block block;
                shared_block(row, b + 32 * k, block);
                add_block<ROWS>(group[k], block, acc);
                squares += block.squares;
            }
        }
#pragma unroll
        for (u32 k = 0; k < GROUP; k++)
            group[k] = next[k];
    }
}

// Lane `lane`'s share of the ROWS outputs from `first`, rounding its own
// blocks of x (rows of more than SHARED_BLOCKS blocks).
template <int ROWS>
static __device__ __forceinline__ void lane_sums(const u32 *quants, const u16 *scales,
                                                 const u16 *offsets, const float *x, u32 up,
                                                 const u16 *weight,
                                                 u32 outputs, u32 blocks, u32 first, u32 lane,
                                                 float acc[ROWS], float &squares) {
#pragma unroll
    for (int r = 0; r < ROWS; r++)
        acc[r] = 0.0f;
    squares = 0.0f;
    for (u32 b = lane; b < blocks; b += 32) {
        // Every row's loads first, so that they are in flight together.
        Values<ROWS> values;
        load_block<ROWS>(quants, scales, offsets, outputs, blocks, first, b, values);
        Block block;
        round_block(x + 32 * b, up, weight ? weight + 32 * b : nullptr, block);
        add_block<ROWS>(values, block, acc);
        squares += block.squares;
    }
}

// The factor the outputs are multiplied by: 1 / rms(x) where the product
// applies an RMSNorm (eps, as f32 bits, not 0; the norm's weight multiplies
// x as it is rounded), else 1. `squares` is Σ x² over the whole row.
static __device__ __forceinline__ float output_factor(float squares, u32 blocks, u32 eps_bits) {
    if (eps_bits == 0)
        return 1.0f;
    float mean = squares * (1.0f / (float)(32 * blocks));
    return 1.0f / __builtin_sqrtf(mean + __builtin_bit_cast(float, eps_bits));
}

// Output `o`, its sum `sum` times `factor`, plus the residual's where there
// is one (OUTPUT_RESIDUAL): the residual added last, as the graph adds it.
static __device__ __forceinline__ float output(float sum, float factor, const float *residual,
                                               u32 o) {
    float y = sum * factor;
    return residual ? residual[o] + y : y;
}

// A warp's ROWS outputs from `first` (whole sums in `sums`) into y: each
// as `output` makes it, or with OUTPUT_SWIGLU each pair of rows (gate,
// up; ROWS and `first` even) as SiLU(gate) · up at y[pair], the values
// the down product would have combined from the pair's outputs.
template <int ROWS>
static __device__ __forceinline__ void write_outputs(const float sums[ROWS], float factor,
                                                     const float *residual, u32 flags,
                                                     u32 first, u32 outputs, float *y) {
    if (flags & OUTPUT_SWIGLU) {
#pragma unroll
        for (int r = 0; r + 1 < ROWS; r += 2)
            if (first + r + 1 < outputs)
                y[(first + r) / 2] = silu(sums[r] * factor) * (sums[r + 1] * factor);
        return;
    }
#pragma unroll
    for (int r = 0; r < ROWS; r++)
        if (first + r < outputs)
            y[first + r] = output(sums[r], factor, residual, first + r);
}

#ifndef KILN_HOST_CHECK
template <int ROWS>
static __device__ __forceinline__ void q4_row(const u32 *quants, const u16 *scales,
                                              const u16 *offsets, const float *x,
                                              const u16 *norm_weight, const float *residual_row,
                                              float *y, u32 outputs, u32 blocks, u32 eps_bits,
                                              u32 flags) {
    // The norm's weight and the residual are bound only where they are
    // used.
    const u16 *weight = eps_bits ? norm_weight : nullptr;
    const float *residual = flags & OUTPUT_RESIDUAL ? residual_row : nullptr;
    u32 up = flags & INPUT_SWIGLU ? 32 * blocks : 0;
    u32 thread = __nvvm_read_ptx_sreg_tid_x();
    u32 lane = thread & 31;
    u32 warp = thread >> 5;
    u32 first = (__nvvm_read_ptx_sreg_ctaid_x() * WARPS + warp) * ROWS;
    float acc[ROWS], squares;
    if (blocks <= SHARED_BLOCKS) {
        Values<ROWS> group[IN_FLIGHT / ROWS];
        load_group<ROWS>(quants, scales, offsets, outputs, blocks, first, lane, group);
        round_row(x, up, weight, blocks, thread, WARPS * 32, shared_row);
        workgroup_barrier();
        lane_sums_shared<ROWS>(quants, scales, offsets, shared_row, outputs, blocks, first, lane,
                               group, acc, squares);
    } else {
        lane_sums<ROWS>(quants, scales, offsets, x, up, weight, outputs, blocks, first, lane, acc,
                        squares);
    }
    // The warp's lanes hold every block between them: Σ x² of the row.
#pragma unroll
    for (int m = 16; m > 0; m >>= 1)
        squares += __nvvm_shfl_sync_bfly_f32(0xffffffffu, squares, m, 31);
    float factor = output_factor(squares, blocks, eps_bits);
#pragma unroll
    for (int r = 0; r < ROWS; r++) {
#pragma unroll
        for (int m = 16; m > 0; m >>= 1)
            acc[r] += __nvvm_shfl_sync_bfly_f32(0xffffffffu, acc[r], m, 31);
    }
    if (lane == 0)
        write_outputs<ROWS>(acc, factor, residual, flags, first, outputs, y);
}

// The one entry point, rows a warp (1, 2 or 4) a constant: IREE gives all
// of a module's dispatches of one object a single executable exporting the
// first dispatch's entry, so entries per row count ran the one-row code
// over a grid made for more rows and left outputs unwritten.
GLOBAL void ENTRY(const u32 *quants, const u16 *scales, const u16 *offsets,
                        const float *x, const u16 *norm_weight, const float *residual, float *y,
                        u32 outputs, u32 blocks, u32 rows, u32 eps_bits, u32 flags) {
#define Q4_ROW(ROWS)                                                                      \
    q4_row<ROWS>(quants, scales, offsets, x, norm_weight, residual, y, outputs, blocks, \
                 eps_bits, flags)
    switch (rows) {
    case 4: Q4_ROW(4); break;
    case 2: Q4_ROW(2); break;
    default: Q4_ROW(1); break;
    }
#undef Q4_ROW
}
#endif
