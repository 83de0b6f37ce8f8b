// rope_append.cu on the host, for kiln-xla's tests (`kernels::tests`):
// every thread of every workgroup of the grid the decode modules launch, one
// after another (the kernel has no barrier). Reads from stdin, as
// little-endian u32s, rows, slots, layers, heads, KV heads, context, head
// width and the layer, then the positions (i32 a row), the projections
// (f32, [rows, (heads + 2 kv) · d]), the cos and sin tables (f32,
// [context, d / 2]), keys and values (f16 bits, the caches' layouts);
// writes q (f16 bits, [rows, heads, d]), then the keys and the values.
#define KILN_HOST_CHECK
#include "rope_append.cu"

#include <cstdio>
#include <cstdlib>
#include <vector>

template <typename T>
static std::vector<T> read(size_t count) {
    std::vector<T> v(count);
    if (fread(v.data(), sizeof(T), count, stdin) != count) {
        fprintf(stderr, "rope_host: short input\n");
        exit(1);
    }
    return v;
}

int main() {
    auto h = read<u32>(8);
    u32 rows = h[0], slots = h[1], layers = h[2], heads = h[3], kv = h[4], context = h[5],
        d = h[6], layer = h[7];
    size_t cache = (size_t)layers * slots * kv * context * d;
    auto positions = read<int>(rows);
    auto qkv = read<float>((size_t)rows * (heads + 2 * kv) * d);
    auto cos_table = read<float>((size_t)context * d / 2);
    auto sin_table = read<float>((size_t)context * d / 2);
    auto keys = read<u16>(cache);
    auto values = read<u16>(cache);
    std::vector<u16> q((size_t)rows * heads * d, 0xffff);
    for (u32 w = 0; w < rows * (heads + kv); w++)
        for (u32 t = 0; t < THREADS; t++) {
            host_workgroup = w;
            host_thread = t;
            kiln_rope_append(qkv.data(), cos_table.data(), sin_table.data(), positions.data(),
                             keys.data(), values.data(), q.data(), layer, slots, heads, kv,
                             context, d);
        }
    fwrite(q.data(), 2, q.size(), stdout);
    fwrite(keys.data(), 2, keys.size(), stdout);
    fwrite(values.data(), 2, values.size(), stdout);
    return 0;
}
