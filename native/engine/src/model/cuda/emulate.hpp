// Runs `kernels.cu` as C++ on CPU threads, for the engine's tests on machines without a GPU:
// a launch runs its blocks one after another on `blockDim.x` threads, with `__syncthreads` a
// barrier of the block's threads and warp shuffles an exchange through memory between a
// warp's barriers. Races the kernels' barriers should prevent show up here as wrong results.
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

struct dim3 {
    unsigned x = 1, y = 1, z = 1;
};
thread_local dim3 threadIdx, blockIdx;
dim3 blockDim, gridDim;

#define __global__
#define __device__
#define __forceinline__ inline
#define __shared__

// the blocks' dynamic shared memory (one block at a time)
alignas(16) float sh[1 << 16];

static std::barrier<>* emu_block;
static std::vector<std::unique_ptr<std::barrier<>>> emu_warps;
static float emu_lanes[1024];

inline void __syncthreads() { emu_block->arrive_and_wait(); }

inline float __shfl_xor_sync(unsigned, float v, int o) {
    const unsigned t = threadIdx.x;
    std::barrier<>& warp = *emu_warps[t >> 5];
    emu_lanes[t] = v;
    warp.arrive_and_wait();
    const float w = emu_lanes[(t & ~31u) | ((t & 31u) ^ (unsigned)o)];
    warp.arrive_and_wait();
    return w;
}

static unsigned emu_match[1024];

inline unsigned __match_any_sync(unsigned, unsigned v) {
    const unsigned t = threadIdx.x, first = t & ~31u;
    std::barrier<>& warp = *emu_warps[t >> 5];
    emu_match[t] = v;
    warp.arrive_and_wait();
    unsigned peers = 0;
    for (unsigned l = 0; l < 32; ++l) peers |= (emu_match[first + l] == v) << l;
    warp.arrive_and_wait();
    return peers;
}

inline int __ffs(unsigned x) { return x ? __builtin_ctz(x) + 1 : 0; }

inline int __popc(unsigned x) { return __builtin_popcount(x); }

inline float __int_as_float(unsigned u) {
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}

inline unsigned __float_as_uint(float f) {
    unsigned u;
    std::memcpy(&u, &f, 4);
    return u;
}

inline float __uint_as_float(unsigned u) { return __int_as_float(u); }

inline unsigned atomicAdd(unsigned* p, unsigned v) { return __atomic_fetch_add(p, v, __ATOMIC_RELAXED); }

inline int min(int a, int b) { return a < b ? a : b; }

inline float h2f(unsigned short h) {
    _Float16 f;
    std::memcpy(&f, &h, 2);
    return (float)f;
}

inline unsigned short f2h(float x) {
    _Float16 f = (_Float16)x;
    unsigned short h;
    std::memcpy(&h, &f, 2);
    return h;
}

// Runs `kernel()` over `grid` blocks of `threads` threads (whole warps).
template <class F>
void emu_launch(dim3 grid, unsigned threads, F kernel) {
    if (threads == 0 || threads % 32 != 0 || threads > 1024) {
        std::fprintf(stderr, "emulate: blocks of %u threads\n", threads);
        std::exit(2);
    }
    gridDim = grid;
    blockDim = dim3{threads, 1, 1};
    std::barrier<> block(threads);
    emu_block = &block;
    emu_warps.clear();
    for (unsigned w = 0; w < threads / 32; ++w) emu_warps.push_back(std::make_unique<std::barrier<>>(32));
    std::vector<std::thread> pool;
    for (unsigned t = 0; t < threads; ++t) {
        pool.emplace_back([&, t] {
            threadIdx = dim3{t, 0, 0};
            for (unsigned z = 0; z < grid.z; ++z)
                for (unsigned y = 0; y < grid.y; ++y)
                    for (unsigned x = 0; x < grid.x; ++x) {
                        blockIdx = dim3{x, y, z};
                        kernel();
                        // the next block may reuse the shared memory
                        block.arrive_and_wait();
                    }
        });
    }
    for (auto& t : pool) t.join();
}

// The test's arrays travel as raw files in the working directory.
template <class T>
std::vector<T> emu_read(const char* name) {
    std::FILE* f = std::fopen(name, "rb");
    if (!f) {
        std::fprintf(stderr, "emulate: no input %s\n", name);
        std::exit(2);
    }
    std::fseek(f, 0, SEEK_END);
    const long bytes = std::ftell(f);
    std::fseek(f, 0, SEEK_SET);
    std::vector<T> v(bytes / sizeof(T));
    if (std::fread(v.data(), 1, bytes, f) != (size_t)bytes) std::exit(2);
    std::fclose(f);
    return v;
}

template <class T>
void emu_write(const char* name, const std::vector<T>& v) {
    std::FILE* f = std::fopen(name, "wb");
    if (!f || std::fwrite(v.data(), sizeof(T), v.size(), f) != v.size()) std::exit(2);
    std::fclose(f);
}
