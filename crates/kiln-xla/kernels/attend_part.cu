// kiln's decode attention on NVIDIA GPUs, first of two kernels: each
// workgroup attends one query row's group of heads (those that share one
// KV head) to one split of the row's visible positions, and writes its
// unnormalised sums with their running max and total, which
// `attend_merge.cu` combines (split-K attention, as flash decoding does).
// Dispatched from the decode modules through `hal.dispatch.extern`
// (crates/kiln-xla/src/kernels.rs, `decode_attention`) in place of IREE's
// q·K product, masked softmax and p·V product: three to five kernels a
// layer, and their work over the whole context where this one stops at the
// row's position.
//
// Layout: keys `[layers, slots, kv, context, D]`, values `[layers, slots,
// kv, D, context]` (f16, the decode modules' caches); row r is slot r with
// its position `positions[r]` and sees positions 0..=positions[r]. q is
// f16 `[rows, ...]` with `q_row_stride` elements a row, head h of a row at
// `h · D` (h = kv head · G + g). A workgroup takes GW of the G heads (GW
// divides G): the fewer each takes, the more workgroups share a short
// row's few positions, each with less to do one after the other. Its 128
// threads take the split's positions TILE at a time: thread t scores
// position t against the GW queries (in shared memory, scaled by
// log2(e) / sqrt(D) so that the
// softmax is in powers of two), each warp keeps the running max and total
// of two heads, and thread j (D = 128) or threads 2j, 2j + 1 (D = 64)
// accumulate output column j of every head over the tile, reading value
// row j's contiguous positions. Positions past the row's last are neither
// scored nor read.
//
// Partials: for each (row, kv head, split), G·D sums, then G maxima (log2
// units), then G totals, f32, each workgroup writing its GW heads'.
// Splits past the row's position write nothing
// (the merge reads only the splits the position reaches).
//
// One split (`splits` = 1) is one pass: the workgroup walks all of the
// row's tiles and writes the attention itself, `[rows, kv · G · D]` as the
// merge would (f32, or f16 where `out_half`; zeros for a row with no
// visible position), and no merge runs: a context of one tile, or rows
// enough to fill the GPU (kernels.rs, `attention_splits`).

#include "device.h"

#define THREADS 128
#define TILE 128
#define MAX_GROUP 8
// Probabilities of one head over a tile, with 4 floats of padding after
// position 63 so that the two halves of a 64-wide head's threads read
// different banks.
#define P_ROW (TILE + 8)

SHARED __attribute__((aligned(16))) float shared_q[MAX_GROUP * 128];
SHARED __attribute__((aligned(16))) float shared_p[MAX_GROUP * P_ROW];
SHARED float shared_alpha[MAX_GROUP];
// One pass: 1 / each head's total, for the output.
SHARED float shared_inverse[MAX_GROUP];

static __device__ __forceinline__ u32 p_index(u32 t) { return t + (t / 64) * 4; }

// Halves of the queries each thread loads.
#define Q_A_THREAD (MAX_GROUP * 128 / THREADS)

// acc + Σ a[i] · x[i] over eight, `a` 16-byte aligned in shared memory.
static __device__ __forceinline__ float dot8(float acc, const float *a, const float x[8]) {
    float4 lo = ((const float4 *)a)[0], hi = ((const float4 *)a)[1];
    acc = __builtin_fmaf(lo.x, x[0], acc);
    acc = __builtin_fmaf(lo.y, x[1], acc);
    acc = __builtin_fmaf(lo.z, x[2], acc);
    acc = __builtin_fmaf(lo.w, x[3], acc);
    acc = __builtin_fmaf(hi.x, x[4], acc);
    acc = __builtin_fmaf(hi.y, x[5], acc);
    acc = __builtin_fmaf(hi.z, x[6], acc);
    return __builtin_fmaf(hi.w, x[7], acc);
}

#define LOG2E 1.4426950408889634f
#define NEG_INF (-__builtin_inff())

// A workgroup's GW heads (at most MAX_GROUP) share a KV head: every loop
// over them runs to MAX_GROUP, unrolled, with the heads past GW masked.
template <int D>
static __device__ __forceinline__ void attend_part(const u16 *q, const u16 *keys,
                                                   const u16 *values, const int *positions,
                                                   float *out, u32 layer, u32 slots,
                                                   u32 kv_heads, u32 context, u32 chunk,
                                                   u32 splits, u32 q_row_stride, u32 G,
                                                   u32 GW, u32 out_half) {
    constexpr u32 HALVES = THREADS / D;
    constexpr u32 PER_HALF = TILE / HALVES;
    u32 thread = thread_index();
    u32 lane = thread & 31, warp = thread >> 5;
    u32 wg = workgroup_index();
    u32 parts = G / GW;
    u32 split = wg % splits;
    u32 part = (wg / splits) % parts;
    u32 head = (wg / (splits * parts)) % kv_heads;
    u32 row = wg / (splits * parts * kv_heads);
    // The first of this workgroup's heads within the group.
    u32 g0 = part * GW;
    // The queries' loads first, beside the position's: they do not
    // depend on it.
    const u16 *qh = q + (u64)row * q_row_stride + (head * G + g0) * D;
    u16 qv[Q_A_THREAD];
#pragma unroll
    for (u32 i = 0; i < Q_A_THREAD; i++)
        qv[i] = thread + i * THREADS < GW * D ? qh[thread + i * THREADS] : 0;
    int pos = positions[row];
    u32 n = pos < 0 ? 0 : ((u32)pos + 1 < context ? (u32)pos + 1 : context);
    u32 start = split * chunk;
    u32 j = thread / HALVES, half = thread % HALVES;
    // One pass writes its heads' columns of the row's output.
    u64 row_out = (u64)row * kv_heads * G * D + (head * G + g0) * D;
    if (start >= n) {
        if (splits == 1 && half == 0)
            for (u32 g = 0; g < GW; g++)
                store_float_or_half(out, row_out + g * D + j, 0.0f, out_half);
        return;
    }
    u32 end = start + chunk < n ? start + chunk : n;

    u64 cache = ((u64)(layer * slots + row) * kv_heads + head) * context * D;
    const u16 *k = keys + cache;
    const u16 *v = values + cache;
    float scale = LOG2E / __builtin_sqrtf((float)D);
#pragma unroll
    for (u32 i = 0; i < Q_A_THREAD; i++)
        if (thread + i * THREADS < GW * D)
            shared_q[thread + i * THREADS] = half_to_float(qv[i]) * scale;

    // Heads warp, warp + 4: their running max (log2 units) and total.
    float m_run[2] = {NEG_INF, NEG_INF}, l_run[2] = {0.0f, 0.0f};
    float acc[MAX_GROUP];
#pragma unroll
    for (int g = 0; g < MAX_GROUP; g++)
        acc[g] = 0.0f;

    for (u32 tile = start; tile < end; tile += TILE) {
        u32 count = end - tile < TILE ? end - tile : TILE;
        // Every load of the tile first, so that they are in flight together:
        // thread t's key row (position tile + t), and its value row j's
        // positions of its half of the tile; none past the last position,
        // where the cache holds whatever was there.
        Words key[D / 8], value[PER_HALF / 8];
        const Words *key_row = (const Words *)(k + (u64)(tile + thread) * D);
#pragma unroll
        for (u32 c = 0; c < D / 8; c++)
            key[c] = thread < count ? key_row[c] : Words{};
        u32 first = half * PER_HALF;
        const Words *value_row = (const Words *)(v + (u64)j * context + tile + first);
#pragma unroll
        for (u32 c = 0; c < PER_HALF / 8; c++)
            value[c] = first + 8 * c < count ? value_row[c] : Words{};
        // The queries are in shared memory (the first tile), the last
        // tile's probabilities read.
        workgroup_barrier();

        // Scores: thread t against position tile + t; a warp whose
        // positions are all past the last skips the arithmetic.
        float s[MAX_GROUP];
#pragma unroll
        for (int g = 0; g < MAX_GROUP; g++)
            s[g] = 0.0f;
        if (warp * 32 < count) {
#pragma unroll
            for (u32 c = 0; c < D / 8; c++) {
                float x[8];
                words_to_floats(key[c], x);
#pragma unroll
                for (u32 g = 0; g < MAX_GROUP; g++)
                    if (g < GW)
                        s[g] = dot8(s[g], &shared_q[g * D + 8 * c], x);
            }
        }
#pragma unroll
        for (u32 g = 0; g < MAX_GROUP; g++)
            if (g < GW)
                shared_p[g * P_ROW + p_index(thread)] = thread < count ? s[g] : NEG_INF;
        workgroup_barrier();

        // The tile's max and total of each head, folded into the running
        // ones; the scores become probabilities against the new max.
#pragma unroll
        for (int i = 0; i < 2; i++) {
            u32 g = warp + 4 * i;
            if (g < GW) {
                float *p = &shared_p[g * P_ROW];
                float x[4], top = NEG_INF;
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    x[e] = p[p_index(lane + 32 * e)];
                    top = __builtin_fmaxf(top, x[e]);
                }
                float m_new = __builtin_fmaxf(m_run[i], warp_max(top));
                float total = 0.0f;
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    float pe = exp2(x[e] - m_new);
                    p[p_index(lane + 32 * e)] = pe;
                    total += pe;
                }
                float alpha = exp2(m_run[i] - m_new);
                l_run[i] = l_run[i] * alpha + warp_sum(total);
                m_run[i] = m_new;
                if (lane == 0)
                    shared_alpha[g] = alpha;
            }
        }
        workgroup_barrier();

        // p·V: column j over this thread's half of the tile, up to its
        // last position.
#pragma unroll
        for (u32 g = 0; g < MAX_GROUP; g++)
            if (g < GW)
                acc[g] *= shared_alpha[g];
#pragma unroll
        for (u32 c = 0; c < PER_HALF / 8; c++) {
            if (first + 8 * c >= count)
                break;
            float x[8];
            words_to_floats(value[c], x);
            // Past the last position: zeros (the loads gave zeros where a
            // whole group of eight was past it).
#pragma unroll
            for (u32 e = 0; e < 8; e++)
                if (first + 8 * c + e >= count)
                    x[e] = 0.0f;
#pragma unroll
            for (u32 g = 0; g < MAX_GROUP; g++)
                if (g < GW)
                    acc[g] = dot8(acc[g], &shared_p[g * P_ROW + p_index(first + 8 * c)], x);
        }
    }

#pragma unroll
    for (u32 g = 0; g < MAX_GROUP; g++)
        if (HALVES == 2)
            acc[g] += shuffle_xor(acc[g], 1);
    if (splits == 1) {
        // Each head's total is its warp's: shared with every column's thread.
#pragma unroll
        for (int i = 0; i < 2; i++) {
            u32 g = warp + 4 * i;
            if (g < GW && lane == 0)
                shared_inverse[g] = l_run[i] > 0.0f ? 1.0f / l_run[i] : 0.0f;
        }
        workgroup_barrier();
#pragma unroll
        for (u32 g = 0; g < MAX_GROUP; g++)
            if (g < GW && half == 0)
                store_float_or_half(out, row_out + g * D + j, acc[g] * shared_inverse[g],
                                    out_half);
        return;
    }
    float *partials = out + ((u64)(row * kv_heads + head) * splits + split) * (G * (D + 2));
#pragma unroll
    for (u32 g = 0; g < MAX_GROUP; g++)
        if (g < GW && half == 0)
            partials[(g0 + g) * D + j] = acc[g];
#pragma unroll
    for (int i = 0; i < 2; i++) {
        u32 g = warp + 4 * i;
        if (g < GW && lane == 0) {
            partials[G * D + g0 + g] = m_run[i];
            partials[G * D + G + g0 + g] = l_run[i];
        }
    }
}

// The one entry point (IREE exports one entry an object); the head width
// (64 or 128), the group's size (1 to 8), the heads a workgroup takes (a
// divisor of it) and whether one pass writes f16 are constants.
KERNEL(THREADS) void kiln_attend_part(
    const u16 *q, const u16 *keys, const u16 *values, const int *positions, float *out,
    u32 layer, u32 slots, u32 kv_heads, u32 context, u32 chunk, u32 splits, u32 q_row_stride,
    u32 d, u32 group, u32 group_heads, u32 out_half) {
    if (d == 128)
        attend_part<128>(q, keys, values, positions, out, layer, slots, kv_heads, context,
                         chunk, splits, q_row_stride, group, group_heads, out_half);
    else
        attend_part<64>(q, keys, values, positions, out, layer, slots, kv_heads, context,
                        chunk, splits, q_row_stride, group, group_heads, out_half);
}
