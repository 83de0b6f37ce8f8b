// attend_part.cu and attend_merge.cu on the host, for kiln-xla's tests
// (`kernels::tests`): every workgroup of both grids the decode modules
// launch (the part's alone where one split makes it one pass), one after
// another, each with its 128 threads. Reads from stdin,
// as little-endian u32s, rows, slots, layers, KV heads, context, head
// width, group, layer, positions a split, splits, the heads a workgroup
// takes and whether the output is f16, then the positions
// (i32 a row), q (f16, [rows, heads, d]), keys and values (f16, the
// caches' layouts); writes the attention (f32 or f16, [rows, heads · d])
// to stdout.
#define KILN_HOST_CHECK
#include "attend_merge.cu"
#include "attend_part.cu"

#include <cstdio>
#include <thread>
#include <vector>

template <typename T>
static std::vector<T> read(size_t count) {
    std::vector<T> v(count);
    if (fread(v.data(), sizeof(T), count, stdin) != count) {
        fprintf(stderr, "attend_host: short input\n");
        exit(1);
    }
    return v;
}

// Runs `body` as workgroup `workgroup`'s threads.
template <typename F>
static void workgroup(u32 index, F body) {
    std::barrier<> all(HOST_THREADS);
    for (u32 w = 0; w < HOST_THREADS / 32; w++)
        host_warp_barriers[w] = new std::barrier<>(32);
    host_workgroup_barrier = &all;
    std::vector<std::thread> threads;
    for (u32 t = 0; t < HOST_THREADS; t++)
        threads.emplace_back([=] {
            host_thread = t;
            host_workgroup = index;
            body();
        });
    for (auto &t : threads)
        t.join();
    for (u32 w = 0; w < HOST_THREADS / 32; w++)
        delete host_warp_barriers[w];
}

int main() {
    auto h = read<u32>(12);
    u32 rows = h[0], slots = h[1], layers = h[2], kv = h[3], context = h[4], d = h[5],
        group = h[6], layer = h[7], chunk = h[8], splits = h[9], group_heads = h[10],
        out_half = h[11];
    size_t cache = (size_t)layers * slots * kv * context * d;
    auto positions = read<int>(rows);
    auto q = read<u16>((size_t)rows * kv * group * d);
    auto keys = read<u16>(cache);
    auto values = read<u16>(cache);
    // NaN where no split writes: the merge must not read it.
    std::vector<float> partials((size_t)rows * kv * splits * group * (d + 2), std::nanf(""));
    // NaN too in the output (all ones: NaN as f32 and as f16), which one
    // pass (one split) writes itself and must write whole.
    std::vector<float> out((size_t)rows * kv * group * d);
    memset(out.data(), 0xff, out.size() * sizeof(float));
    float *part_out = splits == 1 ? out.data() : partials.data();
    for (u32 w = 0; w < rows * kv * (group / group_heads) * splits; w++)
        workgroup(w, [&] {
            kiln_attend_part(q.data(), keys.data(), values.data(), positions.data(), part_out,
                             layer, slots, kv, context, chunk, splits, kv * group * d, d, group,
                             group_heads, out_half);
        });
    for (u32 w = 0; splits > 1 && w < rows * kv; w++)
        workgroup(w, [&] {
            kiln_attend_merge(partials.data(), positions.data(), out.data(), kv, context, chunk,
                              splits, d, group, out_half);
        });
    fwrite(out.data(), out_half ? 2 : 4, out.size(), stdout);
    return 0;
}
