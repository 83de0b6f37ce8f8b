// q4_row.cu's arithmetic on the host, for kiln-xla's tests
// (`kernels::tests`): every lane of every warp of the grid the decode
// modules launch, run one after another, each warp's lanes summed as the
// kernel's shuffles sum them (in another order). Reads from stdin, as
// little-endian u32s, rows a warp, outputs, blocks a row, the RMSNorm's
// eps (f32 bits; 0 for none) and the flags, then the values (16 bytes a
// block; 32 with Q8_ROW), scales and offsets (f16 bits), x (f32; twice the row with
// INPUT_SWIGLU), with an eps the norm's weight (f16 bits, one an input) and
// with OUTPUT_RESIDUAL the residual row (f32, one an output); writes the
// outputs (f32; with OUTPUT_SWIGLU one a pair of rows) to stdout.
#define KILN_HOST_CHECK
#include "q4_row.cu"

#include <cstdio>
#include <vector>

template <int ROWS>
static void grid(const std::vector<u32> &quants, const std::vector<u16> &scales,
                 const std::vector<u16> &offsets, const float *x, const u16 *weight,
                 const float *residual, float *y, u32 outputs, u32 blocks, u32 eps_bits,
                 u32 flags) {
    u32 up = flags & INPUT_SWIGLU ? 32 * blocks : 0;
    u32 workgroups = (outputs + ROWS * WARPS - 1) / (ROWS * WARPS);
    for (u32 workgroup = 0; workgroup < workgroups; workgroup++) {
        // The workgroup's threads round the row first, as on the GPU.
        bool shared = blocks <= SHARED_BLOCKS;
        if (shared)
            for (u32 thread = 0; thread < WARPS * 32; thread++)
                round_row(x, up, weight, blocks, thread, WARPS * 32, shared_row);
        for (u32 warp = 0; warp < WARPS; warp++) {
            u32 first = (workgroup * WARPS + warp) * ROWS;
            float sums[ROWS] = {}, squares = 0.0f;
            for (u32 lane = 0; lane < 32; lane++) {
                float acc[ROWS], lane_squares;
                if (shared) {
                    Values<ROWS> group[IN_FLIGHT / ROWS] = {};
                    load_group<ROWS>(quants.data(), scales.data(), offsets.data(), outputs,
                                     blocks, first, lane, group);
                    lane_sums_shared<ROWS>(quants.data(), scales.data(), offsets.data(),
                                           shared_row, outputs, blocks, first, lane, group, acc,
                                           lane_squares);
                } else {
                    lane_sums<ROWS>(quants.data(), scales.data(), offsets.data(), x, up,
                                    weight, outputs, blocks, first, lane, acc, lane_squares);
                }
                for (int r = 0; r < ROWS; r++)
                    sums[r] += acc[r];
                squares += lane_squares;
            }
            float factor = output_factor(squares, blocks, eps_bits);
            write_outputs<ROWS>(sums, factor, residual, flags, first, outputs, y);
        }
    }
}

template <typename T>
static bool read(std::vector<T> &v, size_t n) {
    v.resize(n);
    return std::fread(v.data(), sizeof(T), n, stdin) == n;
}

int main() {
    u32 header[5];
    if (std::fread(header, 4, 5, stdin) != 5)
        return 2;
    u32 rows = header[0], outputs = header[1], blocks = header[2], eps_bits = header[3],
        flags = header[4];
    size_t n = (size_t)outputs * blocks;
    u32 width = flags & INPUT_SWIGLU ? 64 * blocks : 32 * blocks;
    std::vector<u32> quants;
    std::vector<u16> scales, offsets;
    std::vector<float4> x(width / 4);
    std::vector<float> xs;
    if (!read(quants, WORDS * n) || !read(scales, n) || !read(offsets, n) || !read(xs, width))
        return 2;
    std::memcpy(x.data(), xs.data(), xs.size() * 4);
    // 16-byte aligned, as the kernel reads it.
    std::vector<Words> weights(blocks * 4);
    std::vector<u16> ws;
    if (eps_bits) {
        if (!read(ws, 32 * blocks))
            return 2;
        std::memcpy(weights.data(), ws.data(), ws.size() * 2);
    }
    const u16 *weight = eps_bits ? (const u16 *)weights.data() : nullptr;
    std::vector<float> residual;
    if (flags & OUTPUT_RESIDUAL && !read(residual, outputs))
        return 2;
    const float *residual_row = flags & OUTPUT_RESIDUAL ? residual.data() : nullptr;
    // With OUTPUT_SWIGLU, one output a pair of rows.
    u32 written = flags & OUTPUT_SWIGLU ? outputs / 2 : outputs;
    std::vector<float> y(written);
    const float *row = (const float *)x.data();
#define GRID(ROWS)                                                                          \
    grid<ROWS>(quants, scales, offsets, row, weight, residual_row, y.data(), outputs, blocks, \
               eps_bits, flags)
    switch (rows) {
    case 1: GRID(1); break;
    case 2: GRID(2); break;
    case 4: GRID(4); break;
    default: return 2;
    }
#undef GRID
    return std::fwrite(y.data(), 4, written, stdout) == written ? 0 : 1;
}
