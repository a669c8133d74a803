// gemm_int8_blocks: the int8 product for many rows (prefill, chunks, decode batches above the
// packed limit) with a Q4_1 weight repacked for it (quant/matmul_paths.py: pack_int8_blocks).
// Per 16 output columns and block of 32 inputs the weight holds one tile of kTileBytes:
//   two halves of 8 columns, each 8 quads of 32 bytes (column c's values 4p..4p+3 at byte 4c
//   of quad p), then d [16] and m [16] as float32 (value = d * q + m, q in 0..15).
// The activations are block_matmul_int8's (int8 per block of 32, xd, xs = xd * sum q: the same
// quantizer, int8_quantize.h), so out[r, n] = sum over blocks of d * xd * sum_j q[j] * xq[r, j]
// + m * xs: the decode product's terms, summed in another order. AVX2 tiles of 3 rows x 16
// columns: maddubs pairs (u8 q <= 15 times s8 xq: |pair| <= 3810) summed in int16 over a
// block's 8 quads (<= 30480, no saturation), widened once per block: ~2x fbgemm's float16-weight
// product at 9-512 rows for [576 -> 3072] on a 2-core AMD EPYC (Zen 3, AVX2), two threads.
//
// This file is compiled for the build machine's own instruction set (-march=native), not
// through target options as block_int8.cpp's loops are: inside `#pragma GCC target` the same
// loop, instruction for instruction, ran ~1.6x slower on that EPYC (not explained; measured
// twice each way). Without AVX2 at build time only the portable tiles exist.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <atomic>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define AIRSERVE_GEMM_AVX2 1
#endif

#include "int8_quantize.h"

namespace {

constexpr int64_t kTileBytes = 640;

struct GemmJob {
  const int8_t* xq;  // [M, K]
  const float* xd;   // [M, nb]
  const float* xs;   // [M, nb]
  int64_t M, K, nb, N;
  const uint8_t* w;  // [N / 16, nb, kTileBytes]
  float* out;        // [M, N]
};

// Not auto-vectorized: the reference the AVX2 tiles are tested against stays plain C++.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC push_options
#pragma GCC optimize("no-tree-vectorize")
#endif
template <int R>
void tile_portable(const GemmJob& j, int64_t g, int64_t r0) {
  const uint8_t* wg = j.w + g * j.nb * kTileBytes;
  for (int r = 0; r < R; ++r) {
    const int64_t row = r0 + r;
    for (int c = 0; c < 16; ++c) {
      float acc = 0.f;
      for (int64_t b = 0; b < j.nb; ++b) {
        const uint8_t* t = wg + b * kTileBytes;
        const uint8_t* q = t + (c / 8) * 256 + (c % 8) * 4;
        const int8_t* x = j.xq + row * j.K + b * 32;
        int32_t s = 0;
        for (int p = 0; p < 8; ++p)
          for (int k = 0; k < 4; ++k) s += int32_t(q[p * 32 + k]) * int32_t(x[4 * p + k]);
        float d, m;
        std::memcpy(&d, t + 512 + 4 * c, 4);
        std::memcpy(&m, t + 576 + 4 * c, 4);
        acc += j.xd[row * j.nb + b] * d * static_cast<float>(s);
        acc += j.xs[row * j.nb + b] * m;
      }
      j.out[row * j.N + g * 16 + c] = acc;
    }
  }
}
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC pop_options
#endif

#if defined(AIRSERVE_GEMM_AVX2)
template <int R>
void tile_avx2(const GemmJob& j, int64_t g, int64_t r0) {
  const int64_t K = j.K, nb = j.nb;
  const uint8_t* wg = j.w + g * nb * kTileBytes;
  const int8_t* xq = j.xq + r0 * K;
  const float* xd = j.xd + r0 * nb;
  const float* xs = j.xs + r0 * nb;
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 f[R][2];
  for (int r = 0; r < R; ++r) {
    f[r][0] = _mm256_setzero_ps();
    f[r][1] = _mm256_setzero_ps();
  }
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* t = wg + b * kTileBytes;
    __m256i a[R][2];
    for (int r = 0; r < R; ++r) {
      a[r][0] = _mm256_setzero_si256();
      a[r][1] = _mm256_setzero_si256();
    }
    for (int p = 0; p < 8; ++p) {
      const __m256i v0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(t + 32 * p));
      const __m256i v1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(t + 256 + 32 * p));
#pragma GCC unroll 3
      for (int r = 0; r < R; ++r) {
        const __m256i x = _mm256_broadcastd_epi32(_mm_loadu_si32(xq + r * K + b * 32 + 4 * p));
        a[r][0] = _mm256_add_epi16(a[r][0], _mm256_maddubs_epi16(v0, x));
        a[r][1] = _mm256_add_epi16(a[r][1], _mm256_maddubs_epi16(v1, x));
        // Keep the sums in registers in this order: GCC otherwise regroups the integer adds
        // into a tree over all eight quads and spills the products to the stack (~1.5x slower).
        __asm__("" : "+x"(a[r][0]), "+x"(a[r][1]));
      }
    }
    const float* dm = reinterpret_cast<const float*>(t + 512);
    const __m256 d0 = _mm256_loadu_ps(dm), d1 = _mm256_loadu_ps(dm + 8);
    const __m256 m0 = _mm256_loadu_ps(dm + 16), m1 = _mm256_loadu_ps(dm + 24);
#pragma GCC unroll 3
    for (int r = 0; r < R; ++r) {
      const __m256 s = _mm256_set1_ps(xd[r * nb + b]);
      const __m256 c = _mm256_set1_ps(xs[r * nb + b]);
      f[r][0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(a[r][0], ones)),
                                _mm256_mul_ps(s, d0), f[r][0]);
      f[r][1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(a[r][1], ones)),
                                _mm256_mul_ps(s, d1), f[r][1]);
      f[r][0] = _mm256_fmadd_ps(c, m0, f[r][0]);
      f[r][1] = _mm256_fmadd_ps(c, m1, f[r][1]);
    }
  }
  for (int r = 0; r < R; ++r) {
    float* o = j.out + (r0 + r) * j.N + g * 16;
    _mm256_storeu_ps(o, f[r][0]);
    _mm256_storeu_ps(o + 8, f[r][1]);
  }
}
#endif

// Column groups g0..g1 (16 outputs each), every row: three at a time, then the one or two left.
template <template <int> class Tile>
void run(const GemmJob& j, int64_t g0, int64_t g1) {
  for (int64_t g = g0; g < g1; ++g) {
    int64_t r = 0;
    for (; r + 3 <= j.M; r += 3) Tile<3>::apply(j, g, r);
    if (j.M - r == 2) Tile<2>::apply(j, g, r);
    if (j.M - r == 1) Tile<1>::apply(j, g, r);
  }
}

template <int R>
struct Portable {
  static void apply(const GemmJob& j, int64_t g, int64_t r0) { tile_portable<R>(j, g, r0); }
};
#if defined(AIRSERVE_GEMM_AVX2)
template <int R>
struct Avx2 {
  static void apply(const GemmJob& j, int64_t g, int64_t r0) { tile_avx2<R>(j, g, r0); }
};
#endif

// x float32 [M, K] (any M) times the repacked weight w (uint8 [N / 16, K / 32, kTileBytes]):
// float32 [M, N]. The AVX2 tiles where this build has them and the int8 products' instruction
// set is not narrowed to "scalar" (airserve_isa::set_int8_isa), else the portable ones.
at::Tensor gemm_int8_blocks(const at::Tensor& x, const at::Tensor& w) {
  const char* op = "airserve::gemm_int8_blocks";
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), op,
              ": x must be a contiguous float32 [M, K] tensor, got ", x.scalar_type(), " ",
              x.sizes());
  TORCH_CHECK(w.dim() == 3 && w.scalar_type() == at::kByte && w.is_contiguous() &&
                  w.size(2) == kTileBytes,
              op, ": w must be a contiguous uint8 [N / 16, K / 32, ", kTileBytes,
              "] weight from pack_int8_blocks, got ", w.scalar_type(), " ", w.sizes());
  const int64_t M = x.size(0), K = x.size(1), nb = w.size(1), N = 16 * w.size(0);
  TORCH_CHECK(K % 32 == 0 && nb == K / 32, op, ": x has K=", K, " inputs, the weight ",
              32 * nb);
  at::Tensor out = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return out;
  std::vector<int8_t> xq(M * K);
  std::vector<float> xd(M * nb), xs(M * nb);
  // Rows quantized on every thread (a prefill chunk's 512 rows are ~1 ms on one core).
  std::atomic<bool> portable{false};
  at::parallel_for(0, M, 16, [&](int64_t r0, int64_t r1) {
    if (airserve_int8::quantize(x.data_ptr<float>() + r0 * K, r1 - r0, K, xq.data() + r0 * K,
                                xd.data() + r0 * nb, xs.data() + r0 * nb))
      portable.store(true);
  });
  const GemmJob job{xq.data(), xd.data(), xs.data(), M, K, nb, N, w.data_ptr<uint8_t>(),
                    out.data_ptr<float>()};
  at::parallel_for(0, N / 16, 1, [&](int64_t g0, int64_t g1) {
#if defined(AIRSERVE_GEMM_AVX2)
    if (!portable.load()) return run<Avx2>(job, g0, g1);
#endif
    run<Portable>(job, g0, g1);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(airserve, CPU, lib) { lib.impl("gemm_int8_blocks", &gemm_int8_blocks); }
