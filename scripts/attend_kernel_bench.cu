// kiln's decode attention kernels (crates/kiln-xla/kernels/attend_part.cu and
// attend_merge.cu; the first alone, in one pass, where there is one split)
// timed alone on the attention of the decode steps kiln
// ships shapes for: one build of their PTX, every layer of a step in a
// captured graph over caches of every layer (past the L2 cache, as a step
// reads them), at several positions. The splits follow kernels.rs's rule
// (`attention_splits`, restated here so that this runs without Rust) unless
// --splits names them. Each shape runs with every choice of the query
// heads a workgroup takes (kernels.rs's `attention_group_heads`: two where
// the group is even, else one; and one, and the whole group) unless
// --group-heads names one. The last layer's outputs are checked against
// attention in doubles.
//
//   nvcc -O2 -arch=sm_90 -o attend_kernel_bench scripts/attend_kernel_bench.cu -lcuda
//   ./attend_kernel_bench PART.ptx MERGE.ptx [--reps N] [--splits S] [--rows R] [--group-heads H]
#include <cuda.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "cuda_check.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

struct Shape {
  const char* model;
  unsigned layers, kv, group, d, context;
};

static const Shape SHAPES[] = {
    {"tinyllama", 22, 4, 8, 64, 640},
    {"8b", 32, 8, 4, 128, 640},
    {"8b", 32, 8, 4, 128, 8192},
};

// kernels.rs: TILE 128, 264 workgroups wanted, at most 64 splits; one split
// is one pass (no merge).
static void splits_for(unsigned rows, unsigned kv, unsigned context, unsigned forced,
                       unsigned& chunk, unsigned& splits) {
  unsigned tiles = (context + 127) / 128;
  unsigned wanted = (264 + rows * kv - 1) / (rows * kv);
  unsigned s = forced ? forced : std::max(1u, std::min(wanted, std::min(tiles, 64u)));
  chunk = (tiles + s - 1) / s * 128;
  splits = (context + chunk - 1) / chunk;
}

static CUfunction load(const char* path, const char* entry) {
  std::ifstream file(path);
  if (!file) {
    std::fprintf(stderr, "cannot read %s\n", path);
    std::exit(1);
  }
  std::stringstream text;
  text << file.rdbuf();
  std::string ptx = text.str();
  CUmodule module;
  check(cuModuleLoadData(&module, ptx.c_str()), path);
  CUfunction f;
  check(cuModuleGetFunction(&f, module, entry), entry);
  return f;
}

int main(int argc, char** argv) {
  if (argc < 3) {
    std::fprintf(stderr,
                 "usage: %s PART.ptx MERGE.ptx [--reps N] [--splits S] [--rows R] [--group-heads H]\n",
                 argv[0]);
    return 2;
  }
  unsigned reps = 20, forced = 0, rows = 1, forced_heads = 0;
  for (int i = 3; i + 1 < argc; i += 2) {
    std::string a = argv[i];
    unsigned v = (unsigned)std::atoi(argv[i + 1]);
    if (a == "--reps") reps = v;
    else if (a == "--splits") forced = v;
    else if (a == "--rows") rows = v;
    else if (a == "--group-heads") forced_heads = v;
  }
  check(cudaFree(nullptr), "context");
  CUfunction part = load(argv[1], "kiln_attend_part");
  CUfunction merge = load(argv[2], "kiln_attend_merge");
  cudaDeviceProp prop;
  check(cudaGetDeviceProperties(&prop, 0), "properties");
  std::printf("%s; %u rows; µs per layer's attention (part + merge), %u replays\n", prop.name,
              rows, reps);
  std::printf("| model | context | position | splits x chunk | heads a workgroup | µs a layer | worst error |\n");
  std::printf("| --- | --- | --- | --- | --- | --- | --- |\n");
  for (const Shape& s : SHAPES) {
    std::vector<unsigned> choices;
    if (forced_heads)
      choices = {forced_heads};
    else
      for (unsigned h : {s.group % 2 == 0 ? 2u : 1u, 1u, s.group})
        if (std::find(choices.begin(), choices.end(), h) == choices.end()) choices.push_back(h);
    unsigned heads = s.kv * s.group, slots = rows;
    size_t cache = (size_t)s.layers * slots * s.kv * s.context * s.d;
    std::vector<__half> keys(cache), values(cache), q((size_t)rows * heads * s.d);
    unsigned seed = 12345;
    auto rnd = [&] {
      seed = seed * 1664525u + 1013904223u;
      return (float)((seed >> 8) & 0xffff) / 32768.0f - 1.0f;
    };
    for (auto& v : keys) v = __float2half(rnd());
    for (auto& v : values) v = __float2half(rnd());
    for (auto& v : q) v = __float2half(rnd() * 2.0f);
    unsigned chunk, splits;
    splits_for(rows, s.kv, s.context, forced, chunk, splits);
    __half *dk, *dv, *dq;
    int* dpos;
    float *dpart, *dout;
    check(cudaMalloc(&dk, cache * 2), "keys");
    check(cudaMalloc(&dv, cache * 2), "values");
    check(cudaMalloc(&dq, q.size() * 2), "q");
    check(cudaMalloc(&dpos, rows * 4), "positions");
    check(cudaMalloc(&dpart, (size_t)rows * s.kv * splits * s.group * (s.d + 2) * 4), "partials");
    check(cudaMalloc(&dout, (size_t)rows * heads * s.d * 4), "out");
    check(cudaMemcpy(dk, keys.data(), cache * 2, cudaMemcpyHostToDevice), "keys");
    check(cudaMemcpy(dv, values.data(), cache * 2, cudaMemcpyHostToDevice), "values");
    check(cudaMemcpy(dq, q.data(), q.size() * 2, cudaMemcpyHostToDevice), "q");
    for (unsigned group_heads : choices)
    for (unsigned position : {16u, 272u, s.context / 2, s.context - 1}) {
      std::vector<int> pos(rows, (int)position);
      check(cudaMemcpy(dpos, pos.data(), rows * 4, cudaMemcpyHostToDevice), "positions");
      cudaStream_t stream;
      check(cudaStreamCreate(&stream), "stream");
      cudaGraph_t graph;
      check(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal), "capture");
      unsigned q_stride = heads * s.d;
      for (unsigned layer = 0; layer < s.layers; layer++) {
        float* part_out = splits == 1 ? dout : dpart;
        // f32 output, as checked below.
        unsigned out_half = 0;
        void* pa[] = {&dq, &dk, &dv, &dpos, &part_out, &layer, &slots, (void*)&s.kv,
                      (void*)&s.context, &chunk, &splits, &q_stride, (void*)&s.d,
                      (void*)&s.group, &group_heads, &out_half};
        check(cuLaunchKernel(part, rows * s.kv * (s.group / group_heads) * splits, 1, 1, 128, 1, 1,
                             0, stream, pa, nullptr),
              "part");
        // One split is one pass: the part writes the output, no merge.
        if (splits == 1) continue;
        void* ma[] = {&dpart, &dpos, &dout, (void*)&s.kv, (void*)&s.context, &chunk, &splits,
                      (void*)&s.d, (void*)&s.group, &out_half};
        check(cuLaunchKernel(merge, rows * s.kv, 1, 1, 128, 1, 1, 0, stream, ma, nullptr),
              "merge");
      }
      check(cudaStreamEndCapture(stream, &graph), "end capture");
      cudaGraphExec_t exec;
      check(cudaGraphInstantiate(&exec, graph, 0), "instantiate");
      check(cudaGraphLaunch(exec, stream), "warm-up");
      check(cudaStreamSynchronize(stream), "warm-up");
      // The last layer's output, checked against doubles for row 0.
      std::vector<float> out((size_t)rows * heads * s.d);
      check(cudaMemcpy(out.data(), dout, out.size() * 4, cudaMemcpyDeviceToHost), "out");
      double worst = 0;
      unsigned layer = s.layers - 1;
      for (unsigned h = 0; h < heads; h++) {
        unsigned k = h / s.group;
        size_t base = (((size_t)layer * slots + 0) * s.kv + k) * s.context * s.d;
        std::vector<double> w(position + 1);
        double top = -1e300, total = 0;
        for (unsigned t = 0; t <= position; t++) {
          double dot = 0;
          for (unsigned j = 0; j < s.d; j++)
            dot += (double)__half2float(q[h * s.d + j]) *
                   (double)__half2float(keys[base + (size_t)t * s.d + j]);
          w[t] = dot / std::sqrt((double)s.d);
          top = std::max(top, w[t]);
        }
        for (auto& x : w) total += (x = std::exp(x - top));
        for (unsigned j = 0; j < s.d; j++) {
          double want = 0;
          for (unsigned t = 0; t <= position; t++)
            want += w[t] * (double)__half2float(values[base + (size_t)j * s.context + t]);
          worst = std::max(worst, std::fabs(want / total - out[h * s.d + j]));
        }
      }
      cudaEvent_t a, b;
      check(cudaEventCreate(&a), "event");
      check(cudaEventCreate(&b), "event");
      check(cudaEventRecord(a, stream), "record");
      for (unsigned r = 0; r < reps; r++) check(cudaGraphLaunch(exec, stream), "launch");
      check(cudaEventRecord(b, stream), "record");
      check(cudaEventSynchronize(b), "sync");
      float ms;
      check(cudaEventElapsedTime(&ms, a, b), "elapsed");
      std::printf("| %s | %u | %u | %u x %u | %u | %.2f | %.1e |\n", s.model, s.context, position,
                  splits, chunk, group_heads, ms * 1000.0 / reps / s.layers, worst);
      cudaGraphExecDestroy(exec);
      cudaGraphDestroy(graph);
      cudaStreamDestroy(stream);
    }
    cudaFree(dk), cudaFree(dv), cudaFree(dq), cudaFree(dpos), cudaFree(dpart), cudaFree(dout);
  }
  return 0;
}
