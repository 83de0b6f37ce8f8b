// The host cost of launching kernels on this machine, the floor under a
// decode step that IREE issues kernel by kernel: cuLaunchKernel with the
// parameters as an array of pointers (as IREE's CUDA driver passes them) and
// as one packed buffer, and a graph of 318 launches (TinyLlama's step)
// captured once and replayed. The kernels do no work, so the times are the
// launches' own. Two ways to replay a step whose buffers move between calls
// are timed too: capturing the step again and updating the instantiated
// graph from it, and setting the parameters of a few nodes before each
// replay.
//
//   nvcc -O2 -o cuda_launch_cost scripts/cuda_launch_cost.cu -lcuda && ./cuda_launch_cost
#include <cuda.h>
#include <cuda_runtime.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>

__global__ void eight_parameters(float* a, float* b, float* c, float* d, long e, long f,
                                 long g, long h) {
  // Never true: the kernel must not be optimised away, nor do work.
  if (threadIdx.x == 1000) a[0] = b[0] + c[0] + d[0] + e + f + g + h;
}

using Clock = std::chrono::steady_clock;

static double micros(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double, std::micro>(b - a).count();
}

static void check(CUresult result, const char* what) {
  if (result != CUDA_SUCCESS) {
    std::fprintf(stderr, "%s failed: %d\n", what, static_cast<int>(result));
    std::exit(1);
  }
}

int main() {
  cudaFree(nullptr);  // creates the primary context
  float* buffer = nullptr;
  cudaMalloc(&buffer, 1024);
  CUfunction function;
  cudaGetFuncBySymbol(reinterpret_cast<cudaFunction_t*>(&function),
                      reinterpret_cast<const void*>(eight_parameters));
  CUstream stream;
  check(cuStreamCreate(&stream, CU_STREAM_NON_BLOCKING), "cuStreamCreate");
  unsigned long long values[8];
  void* pointers[8];
  for (int i = 0; i < 8; ++i) {
    values[i] = reinterpret_cast<unsigned long long>(buffer);
    pointers[i] = &values[i];
  }
  size_t size = sizeof(values);
  void* packed[] = {CU_LAUNCH_PARAM_BUFFER_POINTER, values, CU_LAUNCH_PARAM_BUFFER_SIZE, &size,
                    CU_LAUNCH_PARAM_END};

  const int launches = 20000;
  for (int round = 0; round < 3; ++round) {
    for (int as_packed = 0; as_packed < 2; ++as_packed) {
      check(cuStreamSynchronize(stream), "cuStreamSynchronize");
      auto start = Clock::now();
      for (int i = 0; i < launches; ++i) {
        check(cuLaunchKernel(function, 64, 1, 1, 256, 1, 1, 0, stream,
                             as_packed ? nullptr : pointers, as_packed ? packed : nullptr),
              "cuLaunchKernel");
      }
      auto issued = Clock::now();
      check(cuStreamSynchronize(stream), "cuStreamSynchronize");
      auto done = Clock::now();
      std::printf("launch, parameters %s: issue %.2f us, done %.2f us per kernel\n",
                  as_packed ? "packed  " : "pointers", micros(start, issued) / launches,
                  micros(start, done) / launches);
    }
  }

  const int nodes = 318;
  CUgraph graph;
  CUgraphExec exec;
  check(cuStreamBeginCapture(stream, CU_STREAM_CAPTURE_MODE_GLOBAL), "cuStreamBeginCapture");
  for (int i = 0; i < nodes; ++i) {
    check(cuLaunchKernel(function, 64, 1, 1, 256, 1, 1, 0, stream, pointers, nullptr),
          "cuLaunchKernel");
  }
  check(cuStreamEndCapture(stream, &graph), "cuStreamEndCapture");
  auto start = Clock::now();
  check(cuGraphInstantiate(&exec, graph, 0), "cuGraphInstantiate");
  std::printf("graph of %d kernels: instantiate %.1f us\n", nodes, micros(start, Clock::now()));
  const int replays = 100;
  for (int round = 0; round < 3; ++round) {
    check(cuStreamSynchronize(stream), "cuStreamSynchronize");
    auto start = Clock::now();
    for (int i = 0; i < replays; ++i) check(cuGraphLaunch(exec, stream), "cuGraphLaunch");
    auto issued = Clock::now();
    check(cuStreamSynchronize(stream), "cuStreamSynchronize");
    auto done = Clock::now();
    std::printf("graph of %d kernels: issue %.1f us per graph, done %.2f us per kernel\n", nodes,
                micros(start, issued) / replays, micros(start, done) / replays / nodes);
  }

  // A step captured again each call, its pointers moved, and the instantiated
  // graph updated from the new capture.
  for (int round = 0; round < 3; ++round) {
    check(cuStreamSynchronize(stream), "cuStreamSynchronize");
    double capture_us = 0, update_us = 0;
    auto start = Clock::now();
    for (int i = 0; i < replays; ++i) {
      values[0] = reinterpret_cast<unsigned long long>(buffer) + 16 * (i % 4);
      auto t0 = Clock::now();
      CUgraph step;
      check(cuStreamBeginCapture(stream, CU_STREAM_CAPTURE_MODE_RELAXED), "cuStreamBeginCapture");
      for (int k = 0; k < nodes; ++k) {
        check(cuLaunchKernel(function, 64, 1, 1, 256, 1, 1, 0, stream, pointers, nullptr),
              "cuLaunchKernel");
      }
      check(cuStreamEndCapture(stream, &step), "cuStreamEndCapture");
      auto t1 = Clock::now();
      CUgraphExecUpdateResultInfo info;
      check(cuGraphExecUpdate(exec, step, &info), "cuGraphExecUpdate");
      auto t2 = Clock::now();
      check(cuGraphLaunch(exec, stream), "cuGraphLaunch");
      check(cuGraphDestroy(step), "cuGraphDestroy");
      capture_us += micros(t0, t1);
      update_us += micros(t1, t2);
    }
    auto issued = Clock::now();
    check(cuStreamSynchronize(stream), "cuStreamSynchronize");
    auto done = Clock::now();
    std::printf(
        "recapture + update, %d kernels: capture %.1f us, update %.1f us, issue %.1f us per "
        "step, done %.2f us per kernel\n",
        nodes, capture_us / replays, update_us / replays, micros(start, issued) / replays,
        micros(start, done) / replays / nodes);
  }

  // The instantiated graph kept, and the parameters of a few of its nodes set
  // before each replay.
  size_t count = 0;
  check(cuGraphGetNodes(graph, nullptr, &count), "cuGraphGetNodes");
  CUgraphNode* graph_nodes = new CUgraphNode[count];
  check(cuGraphGetNodes(graph, graph_nodes, &count), "cuGraphGetNodes");
  for (int changed : {8, 64, 318}) {
    check(cuStreamSynchronize(stream), "cuStreamSynchronize");
    auto start = Clock::now();
    for (int i = 0; i < replays; ++i) {
      values[0] = reinterpret_cast<unsigned long long>(buffer) + 16 * (i % 4);
      CUDA_KERNEL_NODE_PARAMS params = {};
      params.func = function;
      params.gridDimX = 64;
      params.gridDimY = params.gridDimZ = 1;
      params.blockDimX = 256;
      params.blockDimY = params.blockDimZ = 1;
      params.kernelParams = pointers;
      for (int k = 0; k < changed && k < static_cast<int>(count); ++k) {
        check(cuGraphExecKernelNodeSetParams(exec, graph_nodes[k], &params),
              "cuGraphExecKernelNodeSetParams");
      }
      check(cuGraphLaunch(exec, stream), "cuGraphLaunch");
    }
    auto issued = Clock::now();
    check(cuStreamSynchronize(stream), "cuStreamSynchronize");
    auto done = Clock::now();
    std::printf(
        "set %d nodes' parameters + replay: issue %.1f us per step, done %.2f us per kernel\n",
        changed, micros(start, issued) / replays, micros(start, done) / replays / nodes);
  }
  delete[] graph_nodes;
  return 0;
}
