// q4_row.cu's GPU instructions for the host, as the PTX ISA defines them,
// so that kiln-xla's tests can run the kernel's arithmetic on the CPU
// (q4_row_host.cpp). Only what the kernel uses.
#include <cstddef>
#include <cstdint>
#include <cmath>
#include <cstring>

#define __device__
#define __forceinline__ inline
#define SHARED
struct alignas(16) float4 {
    float x, y, z, w;
};

// dp2a.{lo,hi}.s32.u32: acc + the two signed 16-bit halves of `levels`
// times bytes 0 and 1 (lo) or 2 and 3 (hi) of `bytes`, unsigned.
static inline u32 dp2a(u32 levels, u32 bytes, u32 acc, int first_byte) {
    int32_t sum = (int32_t)acc;
    sum += (int32_t)(int16_t)(levels & 0xffff) * (int32_t)((bytes >> (8 * first_byte)) & 0xff);
    sum += (int32_t)(int16_t)(levels >> 16) * (int32_t)((bytes >> (8 * first_byte + 8)) & 0xff);
    return (u32)sum;
}
static inline u32 dp2a_lo(u32 levels, u32 bytes, u32 acc) { return dp2a(levels, bytes, acc, 0); }
static inline u32 dp2a_hi(u32 levels, u32 bytes, u32 acc) { return dp2a(levels, bytes, acc, 2); }

// dp2a.{lo,hi}.s32.s32: the same with the bytes signed.
static inline u32 dp2a_signed(u32 levels, u32 bytes, u32 acc, int first_byte) {
    int32_t sum = (int32_t)acc;
    sum += (int32_t)(int16_t)(levels & 0xffff) * (int32_t)(int8_t)(bytes >> (8 * first_byte));
    sum += (int32_t)(int16_t)(levels >> 16) * (int32_t)(int8_t)(bytes >> (8 * first_byte + 8));
    return (u32)sum;
}
static inline u32 dp2a_lo_signed(u32 levels, u32 bytes, u32 acc) {
    return dp2a_signed(levels, bytes, acc, 0);
}
static inline u32 dp2a_hi_signed(u32 levels, u32 bytes, u32 acc) {
    return dp2a_signed(levels, bytes, acc, 2);
}

// prmt.b32 d, a, b, 0x5410.
static inline u32 pack_low_halves(u32 a, u32 b) { return (a & 0xffff) | (b << 16); }

#include "half_host.h"

// ex2.approx.f32, as exactly as the host can (the GPU's is within 2 ulp).
static inline float exp2(float x) { return std::exp2(x); }

static inline void load_values(const u32 *p, u32 v[4]) { std::memcpy(v, p, 16); }
