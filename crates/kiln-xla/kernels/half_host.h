// The host builds of kiln's kernels (q4_row_host.h, device_host.h): what
// `cvt.f32.f16` and `cvt.rn.f16.f32` do, as PTX defines them. Needs u32 and
// u16.
#pragma once

#include <cmath>
#include <cstring>

// cvt.f32.f16: exact (every f16 is an f32).
static inline float half_to_float(u16 h) {
    u32 sign = (u32)(h >> 15) << 31, exponent = (h >> 10) & 0x1f, mantissa = h & 0x3ff;
    u32 bits;
    if (exponent == 0x1f) {
        bits = sign | 0x7f800000 | (mantissa << 13);
    } else if (exponent != 0) {
        bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
    } else if (mantissa == 0) {
        bits = sign;
    } else {
        // Subnormal: normalise.
        int shift = 0;
        while (!(mantissa & 0x400)) {
            mantissa <<= 1;
            shift++;
        }
        bits = sign | ((u32)(113 - shift) << 23) | ((mantissa & 0x3ff) << 13);
    }
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
}

// cvt.rn.f16.f32: to the nearest f16, ties to even; beyond the largest
// finite f16 (and its half step) infinity, NaN stays NaN.
static inline u16 float_to_half(float f) {
    u32 bits;
    std::memcpy(&bits, &f, 4);
    u32 sign = (bits >> 16) & 0x8000, magnitude = bits & 0x7fffffff;
    if (magnitude > 0x7f800000)
        return (u16)(sign | 0x7e00 | ((magnitude >> 13) & 0x3ff));
    if (magnitude >= 0x477ff000)
        return (u16)(sign | 0x7c00);
    if (magnitude < 0x38800000) {
        // Below f16's smallest normal: a multiple of 2^-24, exactly scaled
        // and rounded to even (the host's rounding mode); 1024 multiples
        // encode as the smallest normal, as they should.
        float m;
        std::memcpy(&m, &magnitude, 4);
        return (u16)(sign | (u32)std::nearbyint(m * 16777216.0f));
    }
    u32 half = (((magnitude >> 23) - 112) << 10) | ((magnitude >> 13) & 0x3ff);
    u32 rest = magnitude & 0x1fff;
    if (rest > 0x1000 || (rest == 0x1000 && (half & 1)))
        half++;
    return (u16)(sign | half);
}
