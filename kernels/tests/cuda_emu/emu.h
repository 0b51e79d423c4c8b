// A CPU emulator of the CUDA built-ins `paged_decode.cu` uses, so the
// tests can run the kernel source itself without a GPU: every CUDA thread
// of a block is an OS thread, blocks run one after another (so
// `__shared__` arrays can be function statics), `__syncthreads` is a
// barrier over the block and a warp shuffle an exchange between two
// barriers over the warp. Included before the kernel source
// (`-include emu.h`), with KVFORGE_HOST_EMULATION defined.

#pragma once

#include <algorithm>
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

struct dim3 {
    unsigned x = 1, y = 1, z = 1;
};

inline thread_local dim3 threadIdx, blockIdx;
inline dim3 gridDim, blockDim;

#define __global__
#define __device__
#define __forceinline__ inline
#define __restrict__
#define __launch_bounds__(n)
#define __shared__ static

struct float2 {
    float x, y;
};
struct float4 {
    float x, y, z, w;
};
struct uint2 {
    unsigned int x, y;
};

using std::min;

inline float __int_as_float(int i) {
    float f;
    std::memcpy(&f, &i, 4);
    return f;
}
inline float __uint_as_float(unsigned int i) {
    float f;
    std::memcpy(&f, &i, 4);
    return f;
}
inline float __expf(float x) { return std::exp(x); }

// IEEE half to float, exactly (subnormals, infinities and NaN included).
inline float emu_f16_to_f32(unsigned short h) {
    const unsigned sign = (h >> 15) & 1u, exp = (h >> 10) & 0x1fu, mant = h & 0x3ffu;
    float v;
    if (exp == 0)
        v = std::ldexp((float)mant, -24);
    else if (exp == 31)
        v = mant ? NAN : INFINITY;
    else
        v = std::ldexp((float)(mant | 0x400u), (int)exp - 25);
    return sign ? -v : v;
}

struct Block {
    std::unique_ptr<std::barrier<>> all;
    std::vector<std::unique_ptr<std::barrier<>>> warps;
    std::vector<float> xchg;
};
inline Block* g_block = nullptr;

inline void __syncthreads() { g_block->all->arrive_and_wait(); }

inline float __shfl_xor_sync(unsigned, float v, int lane_mask) {
    const unsigned t = threadIdx.x, w = t / 32, lane = t % 32;
    g_block->xchg[t] = v;
    g_block->warps[w]->arrive_and_wait();
    const float r = g_block->xchg[w * 32 + (lane ^ (unsigned)lane_mask)];
    g_block->warps[w]->arrive_and_wait();
    return r;
}

// Runs `kernel()` over `grid` × `block` (x and y), one block at a time.
template <class F>
void emu_launch(dim3 grid, dim3 block, F kernel) {
    gridDim = grid;
    blockDim = block;
    for (unsigned by = 0; by < grid.y; ++by) {
        for (unsigned bx = 0; bx < grid.x; ++bx) {
            Block b;
            b.all = std::make_unique<std::barrier<>>(block.x);
            for (unsigned w = 0; w < (block.x + 31) / 32; ++w)
                b.warps.push_back(std::make_unique<std::barrier<>>(std::min(32u, block.x - 32 * w)));
            b.xchg.assign(block.x, 0.f);
            g_block = &b;
            std::vector<std::thread> threads;
            for (unsigned t = 0; t < block.x; ++t) {
                threads.emplace_back([=] {
                    threadIdx = dim3{t, 0, 0};
                    blockIdx = dim3{bx, by, 0};
                    kernel();
                });
            }
            for (auto& th : threads) th.join();
            g_block = nullptr;
        }
    }
}
