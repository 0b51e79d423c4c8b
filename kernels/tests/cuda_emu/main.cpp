// Runs paged_decode.cu's two kernels under the emulator (emu.h) on one
// step read from the file named by argv[1], and writes the output
// (`[heads][D]` f32) and, when asked, the scaled logits (`[heads][keys]`
// f32) to the file named by argv[2]. Input, little-endian: 16 i32 —
// kind (0 f32, 1 f16, 2 bf16), D, heads, kv_heads, keys, split_len,
// want_scores, cold_tokens, k_bits, k_group, k_per_channel, v_bits,
// v_group, v_per_channel, has_cold, keys ahead (2 or 4) — then 10 arrays, each a u64 byte
// count and its bytes: q (f32), k_pool, v_pool, table (i64), key codes,
// key scales, key minima, value codes, value scales, value minima.

#include <cstdio>
#include <fstream>
#include <iterator>
#include <stdexcept>
#include <string>

extern "C" void paged_decode_merge(const float*, const float*, int, int, int, float*, float*);

#define DECL(NAME)                                                                                  \
    extern "C" void NAME(const float*, const void*, const void*, const long long*, int, int, int, \
                         int, float, float*, float*, float*, const unsigned char*,                 \
                         const unsigned short*, const unsigned short*, int, int, int,              \
                         const unsigned char*, const unsigned short*, const unsigned short*, int,  \
                         int, int, int);
DECL(paged_decode_part_f32_d64_u2_g4)
DECL(paged_decode_part_f32_d64_u2_g8)
DECL(paged_decode_part_f32_d64_u4_g4)
DECL(paged_decode_part_f32_d64_u4_g8)
DECL(paged_decode_part_f32_d128_u2_g4)
DECL(paged_decode_part_f32_d128_u2_g8)
DECL(paged_decode_part_f32_d128_u4_g4)
DECL(paged_decode_part_f32_d128_u4_g8)
DECL(paged_decode_part_f32_d256_u2_g4)
DECL(paged_decode_part_f32_d256_u2_g8)
DECL(paged_decode_part_f32_d256_u4_g4)
DECL(paged_decode_part_f32_d256_u4_g8)
DECL(paged_decode_part_f16_d64_u2_g4)
DECL(paged_decode_part_f16_d64_u2_g8)
DECL(paged_decode_part_f16_d64_u4_g4)
DECL(paged_decode_part_f16_d64_u4_g8)
DECL(paged_decode_part_f16_d128_u2_g4)
DECL(paged_decode_part_f16_d128_u2_g8)
DECL(paged_decode_part_f16_d128_u4_g4)
DECL(paged_decode_part_f16_d128_u4_g8)
DECL(paged_decode_part_f16_d256_u2_g4)
DECL(paged_decode_part_f16_d256_u2_g8)
DECL(paged_decode_part_f16_d256_u4_g4)
DECL(paged_decode_part_f16_d256_u4_g8)
DECL(paged_decode_part_bf16_d64_u2_g4)
DECL(paged_decode_part_bf16_d64_u2_g8)
DECL(paged_decode_part_bf16_d64_u4_g4)
DECL(paged_decode_part_bf16_d64_u4_g8)
DECL(paged_decode_part_bf16_d128_u2_g4)
DECL(paged_decode_part_bf16_d128_u2_g8)
DECL(paged_decode_part_bf16_d128_u4_g4)
DECL(paged_decode_part_bf16_d128_u4_g8)
DECL(paged_decode_part_bf16_d256_u2_g4)
DECL(paged_decode_part_bf16_d256_u2_g8)
DECL(paged_decode_part_bf16_d256_u4_g4)
DECL(paged_decode_part_bf16_d256_u4_g8)

using Part = decltype(&paged_decode_part_f32_d64_u2_g4);

int main(int argc, char** argv) {
    if (argc != 3) {
        std::fprintf(stderr, "usage: emu IN OUT\n");
        return 2;
    }
    std::ifstream in(argv[1], std::ios::binary);
    std::vector<char> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    size_t at = 0;
    auto take = [&](size_t n) {
        if (at + n > bytes.size()) throw std::runtime_error("truncated input");
        const char* p = bytes.data() + at;
        at += n;
        return p;
    };
    int h[16];
    std::memcpy(h, take(sizeof h), sizeof h);
    const int kind = h[0], D = h[1], heads = h[2], kv_heads = h[3], keys = h[4], split_len = h[5];
    const int want_scores = h[6], cold_tokens = h[7], has_cold = h[14];
    std::vector<std::vector<char>> arr(10);
    for (auto& a : arr) {
        uint64_t n;
        std::memcpy(&n, take(8), 8);
        const char* p = take(n);
        a.assign(p, p + n);  // a fresh allocation: 16-byte aligned
    }
    auto ptr = [&](int i) -> const void* { return arr[i].empty() ? nullptr : arr[i].data(); };
    // [kind][head dim][keys ahead][group bound 4 or 8]
    Part parts[3][3][2][2] = {
        {
            {{paged_decode_part_f32_d64_u2_g4, paged_decode_part_f32_d64_u2_g8},
             {paged_decode_part_f32_d64_u4_g4, paged_decode_part_f32_d64_u4_g8}},
            {{paged_decode_part_f32_d128_u2_g4, paged_decode_part_f32_d128_u2_g8},
             {paged_decode_part_f32_d128_u4_g4, paged_decode_part_f32_d128_u4_g8}},
            {{paged_decode_part_f32_d256_u2_g4, paged_decode_part_f32_d256_u2_g8},
             {paged_decode_part_f32_d256_u4_g4, paged_decode_part_f32_d256_u4_g8}},
        },
        {
            {{paged_decode_part_f16_d64_u2_g4, paged_decode_part_f16_d64_u2_g8},
             {paged_decode_part_f16_d64_u4_g4, paged_decode_part_f16_d64_u4_g8}},
            {{paged_decode_part_f16_d128_u2_g4, paged_decode_part_f16_d128_u2_g8},
             {paged_decode_part_f16_d128_u4_g4, paged_decode_part_f16_d128_u4_g8}},
            {{paged_decode_part_f16_d256_u2_g4, paged_decode_part_f16_d256_u2_g8},
             {paged_decode_part_f16_d256_u4_g4, paged_decode_part_f16_d256_u4_g8}},
        },
        {
            {{paged_decode_part_bf16_d64_u2_g4, paged_decode_part_bf16_d64_u2_g8},
             {paged_decode_part_bf16_d64_u4_g4, paged_decode_part_bf16_d64_u4_g8}},
            {{paged_decode_part_bf16_d128_u2_g4, paged_decode_part_bf16_d128_u2_g8},
             {paged_decode_part_bf16_d128_u4_g4, paged_decode_part_bf16_d128_u4_g8}},
            {{paged_decode_part_bf16_d256_u2_g4, paged_decode_part_bf16_d256_u2_g8},
             {paged_decode_part_bf16_d256_u4_g4, paged_decode_part_bf16_d256_u4_g8}},
        },
    };
    const int di = D == 64 ? 0 : D == 128 ? 1 : 2;
    const Part part = parts[kind][di][h[15] == 4 ? 1 : 0][heads / kv_heads <= 4 ? 0 : 1];
    const int splits = (keys + split_len - 1) / split_len;
    std::vector<float> ml(2 * splits * heads), acc((size_t)splits * heads * D), out(heads * D);
    std::vector<float> scores(want_scores ? (size_t)heads * keys : 0);
    const float scale = 1.0f / std::sqrt((float)D);
    emu_launch(dim3{(unsigned)kv_heads, (unsigned)splits, 1}, dim3{128, 1, 1}, [&] {
        part((const float*)ptr(0), ptr(1), ptr(2), (const long long*)ptr(3), keys, heads, kv_heads,
             split_len, scale, ml.data(), acc.data(), want_scores ? scores.data() : nullptr,
             (const unsigned char*)ptr(4), (const unsigned short*)ptr(5),
             (const unsigned short*)ptr(6), h[8], h[9], h[10], (const unsigned char*)ptr(7),
             (const unsigned short*)ptr(8), (const unsigned short*)ptr(9), h[11], h[12], h[13],
             has_cold ? cold_tokens : 1);
    });
    emu_launch(dim3{(unsigned)heads, 1, 1}, dim3{(unsigned)std::min(D, 256), 1, 1}, [&] {
        paged_decode_merge(ml.data(), acc.data(), splits, heads, D, out.data(), nullptr);
    });
    std::ofstream o(argv[2], std::ios::binary);
    o.write((const char*)out.data(), out.size() * 4);
    o.write((const char*)scores.data(), scores.size() * 4);
    return o.good() ? 0 : 1;
}
