// kiln's decode step's rotary embedding and cache append on NVIDIA GPUs, one
// kernel where IREE's graph runs three (the rotation, then a scatter into
// each cache): dispatched from the decode modules through
// `hal.dispatch.extern` (crates/kiln-xla/src/kernels.rs, `rope_append`)
// with the caches tied to its results, so that it writes them in place.
//
// Each workgroup takes one head of one row: row r is slot r at position
// `positions[r]`. The row's q, k and v projections (f32 `[rows, (heads +
// 2 kv) · D]`, as the product wrote them) are rounded to f16 first, as the
// graph rounds them to the caches' precision; q and k heads are rotated
// (rotate-half: element i < D/2 pairs with i + D/2) in f32 with the cos and
// sin tables' row of the position (`[context, D/2]`, the position clamped
// into them, as the graph's gather clamps it) and rounded again; q goes to
// the output `[rows, heads, D]`, k to keys `[layers, slots, kv, context,
// D]` at the position, v unrotated to values `[layers, slots, kv, D,
// context]`. A position outside the context writes nothing to the caches,
// as the graph's scatter ignores it.

#include "device.h"

#define THREADS 128

// f32 through f16 and back: the value the caches' precision keeps.
static __device__ __forceinline__ float through_half(float f) {
    return half_to_float(float_to_half(f));
}

KERNEL(THREADS)
void kiln_rope_append(const float *qkv, const float *cos_table, const float *sin_table,
                      const int *positions, u16 *keys, u16 *values, u16 *q, u32 layer,
                      u32 slots, u32 heads, u32 kv_heads, u32 context, u32 d) {
    u32 w = workgroup_index(), t = thread_index();
    u32 row = w / (heads + kv_heads), head = w % (heads + kv_heads);
    u32 half = d / 2;
    int position = positions[row];
    bool in_context = position >= 0 && (u32)position < context;
    u32 table_row = position < 0 ? 0 : in_context ? (u32)position : context - 1;
    const float *x = qkv + (u64)row * (heads + 2 * kv_heads) * d + (u64)head * d;
    // The row's slot of the layer's caches, for a KV head.
    u32 kv_head = head - heads;
    u64 slot_base = (((u64)layer * slots + row) * kv_heads + kv_head) * d * context;
    if (t < half) {
        float x1 = through_half(x[t]), x2 = through_half(x[t + half]);
        float c = cos_table[(u64)table_row * half + t];
        float s = sin_table[(u64)table_row * half + t];
        u16 first = float_to_half(x1 * c + x2 * -s);
        u16 second = float_to_half(x2 * c + x1 * s);
        if (head < heads) {
            u16 *out = q + ((u64)row * heads + head) * d;
            out[t] = first;
            out[t + half] = second;
        } else if (in_context) {
            u16 *key = keys + slot_base + (u64)position * d;
            key[t] = first;
            key[t + half] = second;
        }
    }
    // The value row of a KV head: v sits kv_heads heads after its k.
    if (head >= heads && in_context && t < d)
        values[slot_base + (u64)t * context + position] = float_to_half(x[kv_heads * d + t]);
}
