// q4_row.cu's arithmetic on the host, for kiln-xla's tests
// (`kernels::tests`): every lane of every warp of the grid the decode
// modules launch, run one after another, each warp's lanes summed as the
// kernel's shuffles sum them (in another order). Reads from stdin, as
// little-endian u32s, rows a warp, outputs, blocks a row and workgroups
// in the grid, then the
// values (16 bytes a block), scales and offsets (f16 bits) and x (f32);
// writes the outputs (f32) to stdout.
#define KILN_HOST_CHECK
#include "q4_row.cu"

#include <cstdio>
#include <vector>

// Each lane's sums added into the outputs, lane after lane (the kernel's
// shuffles add them in another order).
template <int ROWS>
struct AddOutputs {
    float *y;
    u32 outputs;
    void operator()(u32 first, float acc[ROWS]) const {
        for (int r = 0; r < ROWS; r++)
            if (first + r < outputs)
                y[first + r] += acc[r];
    }
};

template <int ROWS>
static void grid(const std::vector<u32> &quants, const std::vector<u16> &scales,
                 const std::vector<u16> &offsets, const float *x, float *y, u32 outputs,
                 u32 blocks, u32 workgroups) {
    u32 tiles = (outputs + ROWS * WARPS - 1) / (ROWS * WARPS);
    AddOutputs<ROWS> add = {y, outputs};
    for (u32 workgroup = 0; workgroup < workgroups && workgroup < tiles; workgroup++) {
        // The workgroup's threads round the row first, as on the GPU.
        bool shared = blocks <= SHARED_BLOCKS;
        if (shared)
            for (u32 thread = 0; thread < WARPS * 32; thread++)
                round_row(x, blocks, thread, WARPS * 32, shared_row);
        for (u32 warp = 0; warp < WARPS; warp++) {
            for (u32 lane = 0; lane < 32; lane++) {
                if (shared) {
                    Values<ROWS> group[IN_FLIGHT / ROWS] = {};
                    load_group<ROWS>(quants.data(), scales.data(), offsets.data(), outputs,
                                     blocks, first_output<ROWS>(workgroup, warp), lane, group);
                    lane_tiles<ROWS>(quants.data(), scales.data(), offsets.data(), shared_row,
                                     outputs, blocks, workgroup, tiles, workgroups, warp, lane,
                                     group, add);
                } else {
                    for (u32 tile = workgroup; tile < tiles; tile += workgroups) {
                        float acc[ROWS];
                        lane_sums<ROWS>(quants.data(), scales.data(), offsets.data(), x,
                                        outputs, blocks, first_output<ROWS>(tile, warp), lane,
                                        acc);
                        add(first_output<ROWS>(tile, warp), acc);
                    }
                }
            }
        }
    }
}

template <typename T>
static bool read(std::vector<T> &v, size_t n) {
    v.resize(n);
    return std::fread(v.data(), sizeof(T), n, stdin) == n;
}

int main() {
    u32 header[4];
    if (std::fread(header, 4, 4, stdin) != 4)
        return 2;
    u32 rows = header[0], outputs = header[1], blocks = header[2], workgroups = header[3];
    size_t n = (size_t)outputs * blocks;
    std::vector<u32> quants;
    std::vector<u16> scales, offsets;
    std::vector<float4> x(blocks * 8);
    std::vector<float> xs;
    if (!read(quants, 4 * n) || !read(scales, n) || !read(offsets, n) || !read(xs, 32 * blocks))
        return 2;
    std::memcpy(x.data(), xs.data(), xs.size() * 4);
    std::vector<float> y(outputs, 0.0f);
    const float *row = (const float *)x.data();
    switch (rows) {
    case 1: grid<1>(quants, scales, offsets, row, y.data(), outputs, blocks, workgroups); break;
    case 2: grid<2>(quants, scales, offsets, row, y.data(), outputs, blocks, workgroups); break;
    case 4: grid<4>(quants, scales, offsets, row, y.data(), outputs, blocks, workgroups); break;
    default: return 2;
    }
    return std::fwrite(y.data(), 4, outputs, stdout) == outputs ? 0 : 1;
}
