// The host builds of kiln's kernels (q4_row_host.h, device_host.h): what
// `cvt.f32.f16` does, as PTX defines it. Needs u32 and u16.
#pragma once

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
