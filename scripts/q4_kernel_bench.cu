// kiln's q4 product kernel (crates/kiln-xla/kernels/q4_row.cu) timed alone
// on the products of the decode steps kiln ships shapes for, against the
// GPU's copy bandwidth: one or more builds of the kernel's PTX side by side
// in one run, so that a change to it is measured before a module embeds it.
//
// Each product's weights are copied until the copies fill well past the L2
// cache, and a captured graph runs the product over every copy in turn, as
// a decode step reads each layer's weights once. Rows a warp follow
// kernels.rs's rule (`q4_rows_per_warp`) unless a build names its own. The
// outputs of the first copy are checked against the product in doubles of
// the dequantized weights on a sample of rows. Each product runs with the
// fusions a decode step gives it (kernels.rs): the RMSNorm before qkv,
// gate-up and the head, the residual after o and down, and down's row read
// as the MLP's SiLU(gate) · up.
//
//   nvcc -O2 -o q4_kernel_bench scripts/q4_kernel_bench.cu -lcuda
//   ./q4_kernel_bench [--reps N] [--only tinyllama|8b] [--profile] NAME=PTX[,warps=8][,min_workgroups=256][,rows=R][,plain=1] ...
//
// --profile launches each product once (the checked launch), for Nsight
// Compute: `ncu -k kiln_q4_row ./q4_kernel_bench --profile ...`.
#include <cuda.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "cuda_check.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

// The kernel's flags (q4_row.cu) and a norm's eps.
enum : unsigned { INPUT_SWIGLU = 1, OUTPUT_RESIDUAL = 2 };
const float EPS = 1e-5f;

struct Shape {
  const char* model;
  const char* name;
  int out, in, per_step;  // per_step: how many of it a decode step runs
  bool norm;              // an RMSNorm before it
  unsigned flags;
};

// The q4 products of a decode step: TinyLlama-1.1B (22 layers) and
// Llama-3.1-8B (32 layers), q/k/v and gate/up each one product.
static const Shape SHAPES[] = {
    {"tinyllama", "qkv", 2560, 2048, 22, true, 0},
    {"tinyllama", "o", 2048, 2048, 22, false, OUTPUT_RESIDUAL},
    {"tinyllama", "gate-up", 11264, 2048, 22, true, 0},
    {"tinyllama", "down", 2048, 5632, 22, false, INPUT_SWIGLU | OUTPUT_RESIDUAL},
    {"tinyllama", "head", 32000, 2048, 1, true, 0},
    {"8b", "qkv", 6144, 4096, 32, true, 0},
    {"8b", "o", 4096, 4096, 32, false, OUTPUT_RESIDUAL},
    {"8b", "gate-up", 28672, 4096, 32, true, 0},
    {"8b", "down", 4096, 14336, 32, false, INPUT_SWIGLU | OUTPUT_RESIDUAL},
    {"8b", "head", 128256, 4096, 1, true, 0},
};

struct Build {
  std::string name, path;
  int warps = 8, min_workgroups = 256, rows = 0;
  bool plain = false;  // without the fusions, to see what they cost
  CUmodule module = nullptr;
  CUfunction function = nullptr;
};

static int rows_per_warp(const Build& b, int out) {
  if (b.rows) return b.rows;
  for (int rows : {4, 2})
    if ((out + rows * b.warps - 1) / (rows * b.warps) >= b.min_workgroups) return rows;
  return 1;
}

static Build parse_build(const char* arg) {
  Build b;
  std::string s(arg);
  size_t eq = s.find('=');
  if (eq == std::string::npos) {
    std::fprintf(stderr, "a build is NAME=PTX[,key=value...], not %s\n", arg);
    std::exit(2);
  }
  b.name = s.substr(0, eq);
  std::stringstream rest(s.substr(eq + 1));
  std::string item;
  std::getline(rest, b.path, ',');
  while (std::getline(rest, item, ',')) {
    size_t at = item.find('=');
    std::string key = item.substr(0, at);
    int value = std::atoi(item.c_str() + at + 1);
    if (key == "warps") b.warps = value;
    else if (key == "min_workgroups") b.min_workgroups = value;
    else if (key == "rows") b.rows = value;
    else if (key == "plain") b.plain = value != 0;
    else {
      std::fprintf(stderr, "unknown key %s\n", key.c_str());
      std::exit(2);
    }
  }
  return b;
}

// Deterministic fill: random bytes of quants, scales in [1e-3, 1e-2),
// offsets in [-4e-3, 4e-3), x in [-2, 2).
__device__ unsigned mix(unsigned long long i, unsigned seed) {
  unsigned long long z = i * 0x9e3779b97f4a7c15ull + seed;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return (unsigned)(z ^ (z >> 31));
}
__global__ void fill_bytes(unsigned* p, size_t words, unsigned seed) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < words;
       i += (size_t)gridDim.x * blockDim.x)
    p[i] = mix(i, seed);
}
__global__ void fill_halves(__half* p, size_t n, unsigned seed, float low, float high) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
       i += (size_t)gridDim.x * blockDim.x)
    p[i] = __float2half(low + (high - low) * (mix(i, seed) >> 8) * (1.0f / 16777216.0f));
}
__global__ void fill_floats(float* p, size_t n, unsigned seed) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
       i += (size_t)gridDim.x * blockDim.x)
    p[i] = -2.0f + 4.0f * (mix(i, seed) >> 8) * (1.0f / 16777216.0f);
}

struct Copy {
  CUdeviceptr quants, scales, offsets;
};

static double copy_bandwidth() {
  const size_t bytes = size_t(2) << 30;
  void *a, *b;
  check(cudaMalloc(&a, bytes), "cudaMalloc");
  check(cudaMalloc(&b, bytes), "cudaMalloc");
  cudaMemset(a, 1, bytes);
  cudaEvent_t start, stop;
  cudaEventCreate(&start);
  cudaEventCreate(&stop);
  std::vector<float> ms;
  for (int i = 0; i < 12; i++) {
    cudaEventRecord(start);
    cudaMemcpy(b, a, bytes, cudaMemcpyDeviceToDevice);
    cudaEventRecord(stop);
    cudaEventSynchronize(stop);
    float t;
    cudaEventElapsedTime(&t, start, stop);
    if (i >= 2) ms.push_back(t);
  }
  std::sort(ms.begin(), ms.end());
  cudaFree(a);
  cudaFree(b);
  return 2.0 * bytes / (ms[ms.size() / 2] * 1e-3);
}

int main(int argc, char** argv) {
  int reps = 20;
  std::string only;
  bool profile = false;
  std::vector<Build> builds;
  for (int i = 1; i < argc; i++) {
    if (!std::strcmp(argv[i], "--reps") && i + 1 < argc) reps = std::atoi(argv[++i]);
    else if (!std::strcmp(argv[i], "--only") && i + 1 < argc) only = argv[++i];
    else if (!std::strcmp(argv[i], "--profile")) profile = true;
    else builds.push_back(parse_build(argv[i]));
  }
  if (builds.empty()) {
    std::fprintf(stderr, "usage: %s [--reps N] [--only MODEL] NAME=PTX[,warps=W,min_workgroups=M,rows=R]...\n", argv[0]);
    return 2;
  }
  check(cudaFree(nullptr), "cudaFree");
  for (Build& b : builds) {
    std::ifstream in(b.path);
    std::stringstream text;
    text << in.rdbuf();
    std::string ptx = text.str();
    if (ptx.empty()) {
      std::fprintf(stderr, "cannot read %s\n", b.path.c_str());
      return 1;
    }
    char log[8192] = {};
    CUjit_option options[] = {CU_JIT_ERROR_LOG_BUFFER, CU_JIT_ERROR_LOG_BUFFER_SIZE_BYTES};
    void* values[] = {log, (void*)(size_t)sizeof(log)};
    CUresult r = cuModuleLoadDataEx(&b.module, ptx.c_str(), 2, options, values);
    if (r != CUDA_SUCCESS) std::fprintf(stderr, "%s: %s\n", b.path.c_str(), log);
    check(r, "cuModuleLoadDataEx");
    check(cuModuleGetFunction(&b.function, b.module, "kiln_q4_row"), "cuModuleGetFunction");
    int regs = 0, shared = 0;
    cuFuncGetAttribute(&regs, CU_FUNC_ATTRIBUTE_NUM_REGS, b.function);
    cuFuncGetAttribute(&shared, CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES, b.function);
    int blocks_per_sm = 0;
    cuOccupancyMaxActiveBlocksPerMultiprocessor(&blocks_per_sm, b.function, b.warps * 32, 0);
    std::printf("build %s: %s, %d warps, %d registers, %d bytes shared, %d workgroups an SM\n",
                b.name.c_str(), b.path.c_str(), b.warps, regs, shared, blocks_per_sm);
  }
  cudaDeviceProp prop;
  cudaGetDeviceProperties(&prop, 0);
  double bandwidth = copy_bandwidth();
  std::printf("GPU %s, %d SMs, L2 %d MiB; copy bandwidth %.2f TB/s (read + written)\n\n",
              prop.name, prop.multiProcessorCount, prop.l2CacheSize >> 20, bandwidth / 1e12);

  CUstream stream;
  check(cuStreamCreate(&stream, CU_STREAM_NON_BLOCKING), "cuStreamCreate");
  cudaEvent_t start, stop;
  cudaEventCreate(&start);
  cudaEventCreate(&stop);
  std::vector<double> step_us(builds.size() * 2, 0.0);
  std::vector<double> step_bytes(2, 0.0);
  std::printf("| model | product | outputs x inputs | MB | build | rows | us | GB/s | %% of copy | worst error |\n");
  std::printf("|---|---|---|---|---|---|---|---|---|---|\n");
  for (const Shape& s : SHAPES) {
    if (!only.empty() && only != s.model) continue;
    int model = std::strcmp(s.model, "8b") == 0;
    size_t blocks = s.in / 32, n = (size_t)s.out * blocks;
    size_t bytes = n * 16 + n * 4;
    size_t copies = profile ? 1 : std::max<size_t>(2, ((size_t)600 << 20) / bytes + 1);
    std::vector<Copy> all(copies);
    for (size_t c = 0; c < copies; c++) {
      check(cuMemAlloc(&all[c].quants, n * 16), "cuMemAlloc");
      check(cuMemAlloc(&all[c].scales, n * 2), "cuMemAlloc");
      check(cuMemAlloc(&all[c].offsets, n * 2), "cuMemAlloc");
      fill_bytes<<<1024, 256>>>((unsigned*)all[c].quants, n * 4, 1 + (unsigned)c);
      fill_halves<<<1024, 256>>>((__half*)all[c].scales, n, 2, 1e-3f, 1e-2f);
      fill_halves<<<1024, 256>>>((__half*)all[c].offsets, n, 3, -4e-3f, 4e-3f);
    }
    // x is the gate and up halves where the row is SiLU(gate) · up.
    int width = s.flags & INPUT_SWIGLU ? 2 * s.in : s.in;
    CUdeviceptr x, y, norm, residual;
    check(cuMemAlloc(&x, width * 4), "cuMemAlloc");
    check(cuMemAlloc(&y, s.out * 4), "cuMemAlloc");
    check(cuMemAlloc(&norm, s.in * 2), "cuMemAlloc");
    check(cuMemAlloc(&residual, s.out * 4), "cuMemAlloc");
    fill_floats<<<64, 256>>>((float*)x, width, 4);
    fill_halves<<<64, 256>>>((__half*)norm, s.in, 5, 0.5f, 1.5f);
    fill_floats<<<64, 256>>>((float*)residual, s.out, 6);
    check(cudaDeviceSynchronize(), "fill");
    // The reference on sample rows of copy 0, on the row the kernel takes:
    // SiLU(gate) · up, times the norm's weight, the sums times 1 / rms and
    // the residual added.
    std::vector<float> raw(width), hres(s.out);
    std::vector<__half> hnorm(s.in);
    cuMemcpyDtoH(raw.data(), x, width * 4);
    cuMemcpyDtoH(hnorm.data(), norm, s.in * 2);
    cuMemcpyDtoH(hres.data(), residual, s.out * 4);
    std::vector<double> hx(s.in), plain_x(raw.begin(), raw.begin() + s.in);
    double squares = 0;
    for (int i = 0; i < s.in; i++) {
      double v = raw[i];
      if (s.flags & INPUT_SWIGLU) v = v / (1 + std::exp(-v)) * raw[s.in + i];
      squares += v * v;
      hx[i] = s.norm ? v * (double)__half2float(hnorm[i]) : v;
    }
    double factor = s.norm ? 1 / std::sqrt(squares / s.in + EPS) : 1;
    std::vector<int> sample;
    for (int r = 0; r < s.out; r += std::max(1, s.out / 61)) sample.push_back(r);
    sample.push_back(s.out - 1);
    std::vector<double> expected(sample.size()), expected_plain(sample.size());
    double largest = 0, largest_plain = 0;
    for (size_t k = 0; k < sample.size(); k++) {
      size_t row = sample[k];
      std::vector<unsigned char> q(blocks * 16);
      std::vector<__half> sc(blocks), of(blocks);
      cuMemcpyDtoH(q.data(), all[0].quants + row * blocks * 16, blocks * 16);
      cuMemcpyDtoH(sc.data(), all[0].scales + row * blocks * 2, blocks * 2);
      cuMemcpyDtoH(of.data(), all[0].offsets + row * blocks * 2, blocks * 2);
      double sum = 0, plain = 0;
      for (size_t b = 0; b < blocks; b++)
        for (int i = 0; i < 32; i++) {
          int nibble = (q[b * 16 + i / 2] >> (4 * (i % 2))) & 15;
          int value = nibble >= 8 ? nibble - 16 : nibble;
          double w = value * (double)__half2float(sc[b]) + (double)__half2float(of[b]);
          sum += w * hx[b * 32 + i];
          plain += w * plain_x[b * 32 + i];
        }
      sum *= factor;
      if (s.flags & OUTPUT_RESIDUAL) sum += hres[row];
      expected[k] = sum;
      largest = std::max(largest, std::fabs(sum));
      expected_plain[k] = plain;
      largest_plain = std::max(largest_plain, std::fabs(plain));
    }
    for (size_t bi = 0; bi < builds.size(); bi++) {
      Build& b = builds[bi];
      unsigned out = s.out, nblocks = blocks, rows = rows_per_warp(b, s.out);
      unsigned flags = b.plain ? 0 : s.flags;
      float eps = s.norm && !b.plain ? EPS : 0.0f;
      unsigned eps_bits;
      std::memcpy(&eps_bits, &eps, 4);
      unsigned workgroups = (s.out + rows * b.warps - 1) / (rows * b.warps);
      std::vector<std::vector<unsigned long long>> pointers(copies);
      std::vector<std::vector<void*>> params(copies);
      for (size_t c = 0; c < copies; c++) {
        pointers[c] = {all[c].quants, all[c].scales, all[c].offsets, x, norm, residual, y};
        params[c] = {&pointers[c][0], &pointers[c][1], &pointers[c][2], &pointers[c][3],
                     &pointers[c][4], &pointers[c][5], &pointers[c][6], &out, &nblocks,
                     &rows, &eps_bits, &flags};
      }
      auto launch = [&](size_t c) {
        check(cuLaunchKernel(b.function, workgroups, 1, 1, b.warps * 32, 1, 1, 0, stream,
                             params[c].data(), nullptr),
              "cuLaunchKernel");
      };
      check(cuMemsetD8(y, 0xff, s.out * 4), "cuMemsetD8");
      launch(0);
      check(cuStreamSynchronize(stream), "the kernel");
      std::vector<float> got(s.out);
      cuMemcpyDtoH(got.data(), y, s.out * 4);
      double worst = 0;
      for (size_t k = 0; k < sample.size(); k++)
        worst = b.plain ? std::max(worst, std::fabs(got[sample[k]] - expected_plain[k]) / largest_plain)
                        : std::max(worst, std::fabs(got[sample[k]] - expected[k]) / largest);
      if (profile) {
        std::printf("| %s | %s | %d x %d | %.1f | %s | %u | | | | %.2e |\n", s.model, s.name, s.out,
                    s.in, bytes / 1e6, b.name.c_str(), rows, worst);
        continue;
      }
      // One graph: the product over every copy.
      CUgraph graph;
      CUgraphExec exec;
      check(cuStreamBeginCapture(stream, CU_STREAM_CAPTURE_MODE_GLOBAL), "capture");
      for (size_t c = 0; c < copies; c++) launch(c);
      check(cuStreamEndCapture(stream, &graph), "capture");
      check(cuGraphInstantiate(&exec, graph, 0), "cuGraphInstantiate");
      for (int i = 0; i < 2; i++) check(cuGraphLaunch(exec, stream), "cuGraphLaunch");
      std::vector<float> ms;
      for (int i = 0; i < reps; i++) {
        cudaEventRecord(start, stream);
        check(cuGraphLaunch(exec, stream), "cuGraphLaunch");
        cudaEventRecord(stop, stream);
        cudaEventSynchronize(stop);
        float t;
        cudaEventElapsedTime(&t, start, stop);
        ms.push_back(t);
      }
      std::sort(ms.begin(), ms.end());
      double us = ms[ms.size() / 2] * 1e3 / copies;
      std::printf("| %s | %s | %d x %d | %.1f | %s | %u | %.2f | %.0f | %.1f | %.2e |\n", s.model,
                  s.name, s.out, s.in, bytes / 1e6, b.name.c_str(), rows, us, bytes / us / 1e3,
                  100.0 * bytes / us / 1e6 / (bandwidth / 1e12), worst);
      step_us[bi * 2 + model] += us * s.per_step;
      if (bi == 0) step_bytes[model] += (double)bytes * s.per_step;
      cuGraphExecDestroy(exec);
      cuGraphDestroy(graph);
    }
    for (Copy& c : all) {
      cuMemFree(c.quants);
      cuMemFree(c.scales);
      cuMemFree(c.offsets);
    }
    cuMemFree(x);
    cuMemFree(y);
    cuMemFree(norm);
    cuMemFree(residual);
  }
  std::printf("\nProducts of one decode step:\n");
  for (int model = 0; model < 2; model++) {
    if (step_bytes[model] == 0) continue;
    for (size_t bi = 0; bi < builds.size(); bi++)
      std::printf("  %s %s: %.0f us for %.0f MB (%.0f GB/s; %.1f %% of copy)\n",
                  model ? "8b" : "tinyllama", builds[bi].name.c_str(), step_us[bi * 2 + model],
                  step_bytes[model] / 1e6, step_bytes[model] / step_us[bi * 2 + model] / 1e3,
                  100.0 * step_bytes[model] / step_us[bi * 2 + model] / 1e6 / (bandwidth / 1e12));
  }
  return 0;
}
