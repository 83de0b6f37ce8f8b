// kiln's decode attention on NVIDIA GPUs, second of two kernels: the
// partial sums `attend_part.cu` wrote for each split of a row's positions,
// combined into the row's attention output, `[rows, heads · D]` (head h =
// kv head · G + g), f32 or, where `out_half`, f16. A workgroup takes one
// (row, kv head): it weighs each split by 2^(its max − the overall max)
// over the overall total, and sums the splits' columns with those weights. Only the splits the row's
// position reaches are read; a row with no visible position gets zeros.

#include "device.h"

#define THREADS 128
#define MAX_GROUP 8
// Splits a row's positions are cut into at most (kernels.rs caps them).
#define MAX_SPLITS 64

SHARED float shared_weight[MAX_SPLITS * MAX_GROUP];

// Head width D and group size G are the kernel's constants.
KERNEL(THREADS) void kiln_attend_merge(const float *partials, const int *positions, float *out,
                                       u32 kv_heads, u32 context, u32 chunk, u32 splits, u32 D,
                                       u32 G, u32 out_half) {
    u32 thread = thread_index();
    u32 lane = thread & 31, warp = thread >> 5;
    u32 row = workgroup_index() / kv_heads, head = workgroup_index() % kv_heads;
    int pos = positions[row];
    u32 n = pos < 0 ? 0 : ((u32)pos + 1 < context ? (u32)pos + 1 : context);
    u32 live = (n + chunk - 1) / chunk;
    u32 stride = G * (D + 2);
    const float *first = partials + (u64)(row * kv_heads + head) * splits * stride;
    // A warp a head: its lanes take the splits (two each at most), and
    // their max and total are the warp's.
    for (u32 g = warp; g < G; g += THREADS / 32) {
        float m[2], l[2], top = -__builtin_inff();
#pragma unroll
        for (u32 i = 0; i < 2; i++) {
            u32 s = lane + 32 * i;
            m[i] = s < live ? first[s * stride + G * D + g] : -__builtin_inff();
            l[i] = s < live ? first[s * stride + G * D + G + g] : 0.0f;
            top = __builtin_fmaxf(top, m[i]);
        }
        top = warp_max(top);
        float w[2], total = 0.0f;
#pragma unroll
        for (u32 i = 0; i < 2; i++) {
            w[i] = lane + 32 * i < live ? exp2(m[i] - top) : 0.0f;
            total += w[i] * l[i];
        }
        total = warp_sum(total);
        float inverse = total > 0.0f ? 1.0f / total : 0.0f;
#pragma unroll
        for (u32 i = 0; i < 2; i++)
            shared_weight[(lane + 32 * i) * MAX_GROUP + g] = w[i] * inverse;
    }
    workgroup_barrier();
    u64 o = (u64)row * kv_heads * G * D + head * G * D;
    for (u32 i = thread; i < G * D; i += THREADS) {
        u32 g = i / D;
        // Four splits' loads in flight at a time.
        float sum[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        u32 s = 0;
        for (; s + 4 <= live; s += 4) {
#pragma unroll
            for (u32 e = 0; e < 4; e++)
                sum[e] += shared_weight[(s + e) * MAX_GROUP + g] * first[(s + e) * stride + i];
        }
        for (; s < live; s++)
            sum[0] += shared_weight[s * MAX_GROUP + g] * first[s * stride + i];
        store_float_or_half(out, o + i, (sum[0] + sum[1]) + (sum[2] + sum[3]), out_half);
    }
}
