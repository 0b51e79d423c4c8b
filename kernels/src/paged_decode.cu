// Paged decode attention over a mixed-tier table, for NVRTC (no headers).
//
// One decode step: the query heads of one token attend over `keys` keys.
// Key j lives where `table[j]` says: `s >= 0` is row `s` of the hot pool
// (`[slots][kv_heads][D]` in f32, f16 or bf16), `s < 0` is row `-1 - s` of
// the cold pool (blocks of `cold_tokens` rows quantized by kvforge-quant:
// INT8 symmetric or INT4 / INT2 affine, f16 group scales and minima,
// per-token or per-channel (KIVI) groups, codes packed in bit planes).
// Dropped entries are simply not in the table; aliases are rows of their
// canonical block.
//
// Flash-decoding in two launches. `paged_decode_part_*`: grid (kv_heads,
// splits), each block attends its KV head's group of query heads over one
// run of `split_len` keys, a warp per key at a time, U (2 or 4) keys loaded ahead
// (each lane holds D/32 contiguous elements of the query, the key, the
// value and the accumulator in registers; hot rows load as vectors), an
// online softmax per warp (running maximum and sum), the
// warps merged in shared memory into one partial state per split.
// `paged_decode_merge`: grid (heads), merges the splits into the output.
// On request (`scores` not null) the part kernel also writes each scaled
// logit, `[heads][keys]`, from which the caller takes the attention mass.
//
// The CPU tests compile this file (every instantiation appended) as C++
// against a small emulator of the CUDA built-ins (`kernels/tests/cuda_emu`:
// a thread per CUDA thread, barriers for `__syncthreads` and warp
// shuffles) and check it against the Rust kernel; only the `cvt` below
// differs there.

#define WARP 32
#define NWARPS 4

__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000); }

__device__ __forceinline__ float f16_to_f32(unsigned short h) {
#ifdef KVFORGE_HOST_EMULATION
    return emu_f16_to_f32(h);  // the CPU tests' emulator (tests/cuda_emu)
#else
    float f;
    asm("{ cvt.f32.f16 %0, %1; }" : "=f"(f) : "h"(h));
    return f;
#endif
}

__device__ __forceinline__ float bf16_to_f32(unsigned short h) {
    return __uint_as_float(((unsigned int)h) << 16);
}

template <int KIND>
__device__ __forceinline__ float widen(unsigned short h) {
    return KIND == 1 ? f16_to_f32(h) : bf16_to_f32(h);
}

// Elements `base .. base + E` of a hot pool stored as KIND (0 = f32,
// 1 = f16, 2 = bf16), in vector loads: `base` is a multiple of E (a lane's
// share of a head vector) and the pool is 16-byte aligned.
template <int KIND, int E>
__device__ __forceinline__ void load_row(const void* pool, long long base, float (&x)[E]) {
    if (KIND == 0) {
        const float* p = (const float*)pool + base;
        if (E % 4 == 0) {
#pragma unroll
            for (int i = 0; i < E / 4; ++i) {
                const float4 v = ((const float4*)p)[i];
                x[4 * i] = v.x;
                x[4 * i + 1] = v.y;
                x[4 * i + 2] = v.z;
                x[4 * i + 3] = v.w;
            }
        } else {
#pragma unroll
            for (int i = 0; i < E / 2; ++i) {
                const float2 v = ((const float2*)p)[i];
                x[2 * i] = v.x;
                x[2 * i + 1] = v.y;
            }
        }
    } else {
        const unsigned short* p = (const unsigned short*)pool + base;
        if (E % 4 == 0) {
#pragma unroll
            for (int i = 0; i < E / 4; ++i) {
                const uint2 v = ((const uint2*)p)[i];
                x[4 * i] = widen<KIND>((unsigned short)(v.x & 0xffffu));
                x[4 * i + 1] = widen<KIND>((unsigned short)(v.x >> 16));
                x[4 * i + 2] = widen<KIND>((unsigned short)(v.y & 0xffffu));
                x[4 * i + 3] = widen<KIND>((unsigned short)(v.y >> 16));
            }
        } else {
#pragma unroll
            for (int i = 0; i < E / 2; ++i) {
                const unsigned int v = ((const unsigned int*)p)[i];
                x[2 * i] = widen<KIND>((unsigned short)(v & 0xffffu));
                x[2 * i + 1] = widen<KIND>((unsigned short)(v >> 16));
            }
        }
    }
}

// One quantized cold pool (keys or values): same-shape blocks back to back.
struct ColdPool {
    const unsigned char* codes;   // [blocks][tokens * C * bits / 8]
    const unsigned short* scales; // [blocks][groups] f16
    const unsigned short* mins;   // [blocks][groups] f16 (unused for INT8)
    int bits;
    int group;
    int per_channel;
};

// Element (row `t` of block `b`, channel `c`) of a cold pool with `T` rows
// per block and `C` channels per row, as kvforge-quant's GroupQuantizer
// decodes it.
__device__ __forceinline__ float cold_at(const ColdPool& p, long long b, int t, int c, int T, int C) {
    const long long block_bytes = (long long)T * C * p.bits / 8;
    const long long block_groups = (long long)T * C / p.group;
    int byte, plane;
    long long gi;
    if (p.per_channel) {
        // Codes token-major, each row packed like one group of C; group
        // parameters channel-major, one per `group` tokens.
        const int row_bytes = C * p.bits / 8;
        byte = t * row_bytes + c % row_bytes;
        plane = c / row_bytes;
        gi = (long long)c * (T / p.group) + t / p.group;
    } else {
        const long long idx = (long long)t * C + c;
        const int bpg = p.group * p.bits / 8;
        gi = idx / p.group;
        const int within = (int)(idx % p.group);
        byte = (int)(gi * bpg) + within % bpg;
        plane = within / bpg;
    }
    const unsigned char code = p.codes[b * block_bytes + byte];
    const float s = f16_to_f32(p.scales[b * block_groups + gi]);
    if (p.bits == 8) return (float)(signed char)code * s;
    const int q = (code >> (plane * p.bits)) & ((1 << p.bits) - 1);
    return (float)q * s + f16_to_f32(p.mins[b * block_groups + gi]);
}

template <int KIND, int D, int U, int G>
__device__ void part(
    const float* __restrict__ q, const void* __restrict__ k_pool, const void* __restrict__ v_pool,
    const long long* __restrict__ table, int keys, int heads, int kv_heads, int split_len,
    float scale, float* __restrict__ part_ml, float* __restrict__ part_acc, float* __restrict__ scores,
    ColdPool ck, ColdPool cv, int cold_tokens) {
    const int E = D / WARP;
    const int kvh = blockIdx.x, split = blockIdx.y, splits = gridDim.y;
    const int g = heads / kv_heads;
    const int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP;
    const int C = kv_heads * D;
    const int begin = split * split_len;
    const int end = min(keys, begin + split_len);

    __shared__ float sq[G * D];
    __shared__ float sm[NWARPS][G];
    __shared__ float sl[NWARPS][G];
    __shared__ float sacc[NWARPS][G * D];

    for (int i = threadIdx.x; i < g * D; i += blockDim.x) sq[i] = q[kvh * g * D + i] * scale;
    __syncthreads();

    // Lane `lane` holds elements `lane * E .. lane * E + E` of every head
    // vector (contiguous, so hot rows load in vectors).
    float qr[G][E], acc[G][E], m[G], l[G];
#pragma unroll
    for (int h = 0; h < G; ++h) {
        m[h] = neg_inf();
        l[h] = 0.f;
#pragma unroll
        for (int e = 0; e < E; ++e) {
            qr[h][e] = h < g ? sq[h * D + lane * E + e] : 0.f;
            acc[h][e] = 0.f;
        }
    }

    // U keys per warp per iteration, all loaded before any is used (U
    // times the loads in flight, U times the registers).
    for (int j0 = begin + warp; j0 < end; j0 += U * NWARPS) {
        float kx[U][E], vx[U][E];
        int n = 0;
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int j = j0 + u * NWARPS;
            if (j >= end) break;
            ++n;
            const long long s = table[j];
            if (s >= 0) {
                const long long base = s * C + kvh * D + lane * E;
                load_row<KIND, E>(k_pool, base, kx[u]);
                load_row<KIND, E>(v_pool, base, vx[u]);
            } else {
                const long long r = -1 - s;
                const long long b = r / cold_tokens;
                const int t = (int)(r % cold_tokens);
#pragma unroll
                for (int e = 0; e < E; ++e) {
                    const int c = kvh * D + lane * E + e;
                    kx[u][e] = cold_at(ck, b, t, c, cold_tokens, C);
                    vx[u][e] = cold_at(cv, b, t, c, cold_tokens, C);
                }
            }
        }
#pragma unroll
        for (int u = 0; u < U; ++u) {
            if (u >= n) break;
            const int j = j0 + u * NWARPS;
#pragma unroll
            for (int h = 0; h < G; ++h) {
                if (h < g) {
                    float dot = 0.f;
#pragma unroll
                    for (int e = 0; e < E; ++e) dot += qr[h][e] * kx[u][e];
#pragma unroll
                    for (int o = WARP / 2; o > 0; o /= 2) dot += __shfl_xor_sync(0xffffffffu, dot, o);
                    if (scores != 0 && lane == 0) scores[(long long)(kvh * g + h) * keys + j] = dot;
                    const float mn = fmaxf(m[h], dot);
                    const float corr = __expf(m[h] - mn);
                    const float p = __expf(dot - mn);
                    l[h] = l[h] * corr + p;
#pragma unroll
                    for (int e = 0; e < E; ++e) acc[h][e] = acc[h][e] * corr + p * vx[u][e];
                    m[h] = mn;
                }
            }
        }
    }

#pragma unroll
    for (int h = 0; h < G; ++h) {
        if (h < g) {
            if (lane == 0) {
                sm[warp][h] = m[h];
                sl[warp][h] = l[h];
            }
#pragma unroll
            for (int e = 0; e < E; ++e) sacc[warp][h * D + lane * E + e] = acc[h][e];
        }
    }
    __syncthreads();

    // Merge the warps: one partial state per (split, query head).
    for (int i = threadIdx.x; i < g * D; i += blockDim.x) {
        const int h = i / D, d = i % D;
        float mx = neg_inf();
        for (int w = 0; w < NWARPS; ++w) mx = fmaxf(mx, sm[w][h]);
        float sum = 0.f, a = 0.f;
        for (int w = 0; w < NWARPS; ++w) {
            // A warp that saw no key has m = -inf: its weight is 0.
            const float f = sm[w][h] == neg_inf() ? 0.f : __expf(sm[w][h] - mx);
            sum += sl[w][h] * f;
            a += sacc[w][i] * f;
        }
        const int head = kvh * g + h;
        part_acc[((long long)split * heads + head) * D + d] = a;
        if (d == 0) {
            part_ml[split * heads + head] = mx;
            part_ml[(splits + split) * heads + head] = sum;
        }
    }
}

#define PART(NAME, KIND, D, U, G)                                                                      \
    extern "C" __global__ void __launch_bounds__(NWARPS * WARP) NAME(                                 \
        const float* q, const void* k_pool, const void* v_pool, const long long* table, int keys,   \
        int heads, int kv_heads, int split_len, float scale, float* part_ml, float* part_acc,       \
        float* scores, const unsigned char* kc, const unsigned short* ks, const unsigned short* km, \
        int k_bits, int k_group, int k_per_channel, const unsigned char* vc,                         \
        const unsigned short* vs, const unsigned short* vm, int v_bits, int v_group,                \
        int v_per_channel, int cold_tokens) {                                                        \
        ColdPool ck = {kc, ks, km, k_bits, k_group, k_per_channel};                                  \
        ColdPool cv = {vc, vs, vm, v_bits, v_group, v_per_channel};                                  \
        part<KIND, D, U, G>(q, k_pool, v_pool, table, keys, heads, kv_heads, split_len, scale,     \
                         part_ml, part_acc, scores, ck, cv, cold_tokens);                            \
    }

// The instantiations — `PART(paged_decode_part_{f32,f16,bf16}_d{64,128,256}
// _u{2,4}_g{4,8}, kind, D, U, G)`: hot dtype, head dim, keys loaded ahead
// per warp, most query heads per KV head (the registers a lane holds grow
// with it) — are appended by `cuda.rs`: every one for the compile check,
// only the one a step needs when the engine loads them (NVRTC takes about
// 0.2 s for one, 6 s for all 36).

// out[h][d] from the splits' partial states (`part_ml`: maxima then sums,
// `[splits][heads]` each; `part_acc`: `[splits][heads][D]`). With `stats`
// not null, also the final maximum and sum per head (`[2][heads]`).
extern "C" __global__ void paged_decode_merge(const float* part_ml, const float* part_acc, int splits,
                                              int heads, int D, float* out, float* stats) {
    const int h = blockIdx.x;
    float mx = neg_inf();
    for (int s = 0; s < splits; ++s) mx = fmaxf(mx, part_ml[s * heads + h]);
    float sum = 0.f;
    for (int s = 0; s < splits; ++s)
        sum += part_ml[(splits + s) * heads + h] * __expf(part_ml[s * heads + h] - mx);
    for (int d = threadIdx.x; d < D; d += blockDim.x) {
        float a = 0.f;
        for (int s = 0; s < splits; ++s)
            a += part_acc[((long long)s * heads + h) * D + d] * __expf(part_ml[s * heads + h] - mx);
        out[h * D + d] = a / sum;
    }
    if (stats != 0 && threadIdx.x == 0) {
        stats[h] = mx;
        stats[heads + h] = sum;
    }
}
