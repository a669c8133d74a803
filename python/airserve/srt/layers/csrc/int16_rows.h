// Activation rows quantized per block of 32 to int16, for the int16 products (block_int16.cpp:
// Q4_1; block_int16_k.cpp: Q4_K, Q6_K). xd = max|x| / 32767 and xq = round(x / xd) per block,
// xs the float32 block sum; each product stores a block's 32 values in the order its loop pairs
// them with the weights (a map from value j to its slot), so only the store differs.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "cpu_common.h"

#if (defined(__x86_64__) || defined(_M_X64)) && defined(__GNUC__) && !defined(__clang__)
#include <immintrin.h>
#define AIRSERVE_INT16_ROWS_AVX2 1
#endif

namespace airserve_int16 {

constexpr int64_t kBlock = 32;

// One quantized row as the products read it: xq int16 [K] in the product's slot order, xd and
// xs (block scales and float32 block sums) from its first block on.
struct Row {
  const int16_t* xq;
  const float* xd;
  const float* xs;
};

// Whether the AVX2 loops (compiled through target options whatever the build machine) can run.
inline bool avx2_here() {
#if (defined(__x86_64__) || defined(_M_X64)) && defined(__GNUC__) && !defined(__clang__)
  static const bool ok = airserve_cpu::has_avx2_fma() && __builtin_cpu_supports("f16c");
  return ok;
#else
  return false;
#endif
}

// The M rows of x [M, K], each quantized by `quantize(x_row, K, xq, xd, xs)`; xd and xs hold a
// multiple of 8 blocks per row, zero past K / 32 (loops read them eight blocks at a time).
class QuantizedRows {
 public:
  template <typename Quantize>
  QuantizedRows(const float* x, int64_t M, int64_t K, Quantize quantize)
      : nbp_((K / kBlock + 7) / 8 * 8), xq_(M * K), xd_(M * nbp_, 0.f), xs_(M * nbp_, 0.f) {
    rows_.reserve(M);
    for (int64_t r = 0; r < M; ++r) {
      quantize(x + r * K, K, xq_.data() + r * K, xd_.data() + r * nbp_, xs_.data() + r * nbp_);
      rows_.push_back(Row{xq_.data() + r * K, xd_.data() + r * nbp_, xs_.data() + r * nbp_});
    }
  }
  QuantizedRows(const QuantizedRows&) = delete;
  QuantizedRows& operator=(const QuantizedRows&) = delete;
  const Row* rows() const { return rows_.data(); }

 private:
  int64_t nbp_;
  std::vector<int16_t> xq_;
  std::vector<float> xd_, xs_;
  std::vector<Row> rows_;
};

// Plain C++: block b's value j goes to xq[32 b + slot(j)].
template <typename Slot>
void quantize_row_portable(const float* x, int64_t K, int16_t* xq, float* xd, float* xs,
                           Slot slot) {
  for (int64_t b = 0; b < K / kBlock; ++b) {
    const float* xb = x + b * kBlock;
    float amax = 0.f, sum = 0.f;
    for (int j = 0; j < kBlock; ++j) {
      amax = std::max(amax, std::fabs(xb[j]));
      sum += xb[j];
    }
    const float inv = amax > 0.f ? 32767.f / amax : 0.f;
    for (int j = 0; j < kBlock; ++j) {
      const float r = std::nearbyint(xb[j] * inv);
      xq[b * kBlock + slot(j)] = static_cast<int16_t>(std::min(32767.f, std::max(-32767.f, r)));
    }
    xd[b] = amax / 32767.f;
    xs[b] = sum;
  }
}

#ifdef AIRSERVE_INT16_ROWS_AVX2
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")

inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
  return _mm_cvtss_f32(s);
}

// One block of 32 values, as quantize_row_portable computes it (cvtps rounds half to even, as
// nearbyint does under the default rounding mode; the block sum in another order, last-bit
// differences): returns the values in two registers of 16 int16 each, values 0..15 in `lo` and
// 16..31 in `hi`, and in each eight of them the evens before the odds: lo = [x0 x2 x4 x6 x8
// x10 x12 x14 | x1 x3 .. x15] (packs interleaves the two int32 vectors per 128-bit half).
// *xd and *xs take the block's scale and sum.
// With kNatural the values come in their own order instead, lo = [x0 x1 .. x15], hi = [x16 ..
// x31] (the order of a sign-extended int8 block, block_int16.cpp's Q8_0 product).
template <bool kNatural = false>
inline void quantize_block_avx2(const float* xb, __m256i* lo, __m256i* hi, float* xd,
                                float* xs) {
  const __m256 sign = _mm256_set1_ps(-0.f);
  const __m256i evens_odds = _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7);
  __m256 v[4], amax = _mm256_setzero_ps();
  for (int j = 0; j < 4; ++j) {
    v[j] = _mm256_loadu_ps(xb + 8 * j);
    amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[j]));
  }
  *xs = hsum8(_mm256_add_ps(_mm256_add_ps(v[0], v[1]), _mm256_add_ps(v[2], v[3])));
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  m4 = _mm_max_ss(m4, _mm_shuffle_ps(m4, m4, 1));
  const float top = _mm_cvtss_f32(m4);
  const __m256 inv = _mm256_set1_ps(top > 0.f ? 32767.f / top : 0.f);
  __m256i q[4];
  for (int j = 0; j < 4; ++j) {
    q[j] = _mm256_cvtps_epi32(_mm256_mul_ps(v[j], inv));
    if (!kNatural) q[j] = _mm256_permutevar8x32_epi32(q[j], evens_odds);
  }
  *lo = _mm256_packs_epi32(q[0], q[1]);
  *hi = _mm256_packs_epi32(q[2], q[3]);
  if (kNatural) {  // packs gave [a0..a3 b0..b3 | a4..a7 b4..b7]: put the 64-bit quarters back
    *lo = _mm256_permute4x64_epi64(*lo, 0xD8);
    *hi = _mm256_permute4x64_epi64(*hi, 0xD8);
  }
  *xd = top / 32767.f;
}

#pragma GCC pop_options
#endif  // AIRSERVE_INT16_ROWS_AVX2

}  // namespace airserve_int16
