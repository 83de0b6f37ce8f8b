// device.h's GPU names for the host: each workgroup's threads run as real
// threads, its barrier and the warps' shuffles as barriers between them
// (attend_host.cpp runs one workgroup at a time, so shared memory is
// static). Only what the kernels use.

#include <barrier>
#include <cmath>
#include <cstring>

#define __device__
#define __global__
#define __forceinline__ inline
#define SHARED
#define KERNEL(threads) extern "C"

// The running workgroup's size and the thread's coordinates.
constexpr u32 HOST_THREADS = 128;
inline thread_local u32 host_thread, host_workgroup;
inline std::barrier<> *host_workgroup_barrier;
inline std::barrier<> *host_warp_barriers[HOST_THREADS / 32];
inline float host_exchange[HOST_THREADS];

static inline u32 thread_index() { return host_thread; }
static inline u32 workgroup_index() { return host_workgroup; }
static inline void workgroup_barrier() { host_workgroup_barrier->arrive_and_wait(); }

// shfl.sync.bfly over the whole warp: every lane writes, then reads its
// partner's, with the warp's barrier before and after the read.
static inline float shuffle_xor(float v, int mask) {
    u32 warp = host_thread / 32;
    host_exchange[host_thread] = v;
    host_warp_barriers[warp]->arrive_and_wait();
    float theirs = host_exchange[host_thread ^ (u32)mask];
    host_warp_barriers[warp]->arrive_and_wait();
    return theirs;
}

static inline float exp2(float x) { return std::exp2(x); }

#include "half_host.h"
