// Q4_1 and Q8_0 products with int16 activations, for decode (at most 16 rows).
//
// Each row of x is quantized per block of 32 to int16: xd = max|x| / 32767, xq = round(x / xd),
// so an activation's error is at most xd / 2, ~1.5e-5 of its block's largest value (int8
// activations: 256 times that). With value = d * q + m (q 4-bit), a block's product is
//   d * xd * sum(q * xq) + m * sum(x),
// the integer sum exact (|q * xq| < 2^19, 32 terms), sum(x) the float32 block sum.
//
// Why: on a 2-core AMD EPYC with AVX2 only (Zen 3), the float32 Q4_1 product converts every
// 4-bit value to float before its FMA and runs at ~8 cycles a block, compute-bound below the
// memory's pace; int16 multiply-adds (vpmaddwd) take the 4-bit values as they are.
// One thread, one row: [576, 1536] 65.6 -> 39.6 us, [1536, 576] 78.4 -> 53.3 us, [960, 576]
// 50.2 -> 33.4 us (benchmark/kernels/bench_kernels.py's float32 / int16 columns); a decode
// step's 120 Q4_1 products from memory, 2 threads: 5.26 -> 3.81 ms (int8: 3.42;
// bench_decode_bandwidth.py).
//
// The AVX2 loop takes a block's 16 bytes as eight 16-bit lanes, broadcast to both halves of a
// register: masking with 0x000F (low half) and 0x0F00 (high half) gives q[2i] and 256 * q[2i+1];
// the same after a 4-bit shift gives q[2i+16] and 256 * q[2i+17]. The activations are stored in
// that order ([x0 x2 .. x14 | x1 x3 .. x15], then the same for 16..31), so one vpmaddwd per
// half-block pairs them up; the high half's factor of 256 is the same in every block and
// leaves at the end (an exact power-of-two scale). Lane sums stay below 2^29.
//
// Q8_0 (value = d * q, q int8): a block's product is d * xd * sum(q * xq), |q * xq| < 2^22; the
// activations stay in their own order (natural_of) and the AVX2 loop sign-extends the block's
// two halves of 16 bytes to int16 lanes that pair with them. The float32 Q8_0 product
// (block_matvec.cpp) widens each value to int32 and then to float before its FMA: three
// instructions a value where this loop takes two multiply-adds a block.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <utility>

#if (defined(__x86_64__) || defined(_M_X64)) && defined(__GNUC__) && !defined(__clang__)
#include <immintrin.h>
#define AIRSERVE_I16_AVX2 1
#endif

#include "cpu_common.h"
#include "int16_rows.h"

namespace {

using airserve_int16::kBlock;
constexpr int64_t kMaxRows = 16;
constexpr int64_t kGrain = 32;  // output columns per parallel task, at least

using airserve_int16::Row;  // a quantized row, xq in lane_of's order

// Where value j of a block sits in the quantized row: [x0 x2 .. x14 | x1 x3 .. x15], then the
// same for 16..31 (the order the AVX2 loop pairs them in, above).
inline int lane_of(int j) {
  const int half = j < 16 ? 0 : 16, i = j - half;
  return half + (i % 2) * 8 + i / 2;
}

void quantize_row(const float* x, int64_t K, int16_t* xq, float* xd, float* xs) {
  airserve_int16::quantize_row_portable(x, K, xq, xd, xs, lane_of);
}

inline int natural_of(int j) { return j; }

void quantize_row_natural(const float* x, int64_t K, int16_t* xq, float* xd, float* xs) {
  airserve_int16::quantize_row_portable(x, K, xq, xd, xs, natural_of);
}

// Plain C++ Q8_0: the same integer sums as the AVX2 loop, per block.
void column_portable_q8_0(const int8_t* q, const at::Half* d, int64_t nb, const Row& x,
                          float* out) {
  float acc = 0.f;
  for (int64_t b = 0; b < nb; ++b) {
    const int8_t* qb = q + b * kBlock;
    const int16_t* xb = x.xq + b * kBlock;
    int32_t s = 0;
    for (int j = 0; j < kBlock; ++j) s += static_cast<int32_t>(qb[j]) * xb[j];
    acc += static_cast<float>(d[b]) * x.xd[b] * static_cast<float>(s);
  }
  *out = acc;
}

// Plain C++ (any CPU, and the tests' second opinion): the same integer sums, per block.
void column_portable(const uint8_t* q, const at::Half* d, const at::Half* m, int64_t nb,
                     const Row& x, float* out) {
  float acc = 0.f;
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* qb = q + b * 16;
    const int16_t* xb = x.xq + b * kBlock;
    int32_t s = 0;
    for (int j = 0; j < 16; ++j) {
      s += static_cast<int32_t>(qb[j] & 15) * xb[lane_of(j)];
      s += static_cast<int32_t>(qb[j] >> 4) * xb[lane_of(j + 16)];
    }
    acc += static_cast<float>(d[b]) * x.xd[b] * static_cast<float>(s) +
           static_cast<float>(m[b]) * x.xs[b];
  }
  *out = acc;
}

#ifdef AIRSERVE_I16_AVX2
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
namespace i16_avx2 {

using airserve_int16::hsum8;

// Eight fp16 values from p[0..count) (count <= 8), zero past count, as float32. An even
// count (the default model's 576-wide rows end in a group of 2) is one masked load of 32-bit
// pairs, without the store-to-load stall of a copy through memory.
inline __m256 load_half8(const at::Half* p, int64_t count) {
  if (count == 8) return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  if (count % 2 == 0) {
    const __m128i lanes = _mm_setr_epi32(0, 1, 2, 3);
    const __m128i mask = _mm_cmplt_epi32(lanes, _mm_set1_epi32(static_cast<int>(count / 2)));
    return _mm256_cvtph_ps(_mm_maskload_epi32(reinterpret_cast<const int*>(p), mask));
  }
  alignas(16) uint16_t t[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  for (int64_t i = 0; i < count; ++i) t[i] = p[i].x;
  return _mm256_cvtph_ps(_mm_load_si128(reinterpret_cast<const __m128i*>(t)));
}

// quantize_row's values (int16_rows.h): the halves' eight-lane groups are already in lane_of's
// order, [x0 x2 .. x14 | x1 x3 .. x15] and the same for 16..31.
void quantize_row(const float* x, int64_t K, int16_t* xq, float* xd, float* xs) {
  for (int64_t b = 0; b < K / kBlock; ++b) {
    __m256i lo, hi;
    airserve_int16::quantize_block_avx2(x + b * kBlock, &lo, &hi, xd + b, xs + b);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(xq + b * kBlock), lo);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(xq + b * kBlock + 16), hi);
  }
}

// quantize_row_natural's values.
void quantize_row_natural(const float* x, int64_t K, int16_t* xq, float* xd, float* xs) {
  for (int64_t b = 0; b < K / kBlock; ++b) {
    __m256i lo, hi;
    airserve_int16::quantize_block_avx2<true>(x + b * kBlock, &lo, &hi, xd + b, xs + b);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(xq + b * kBlock), lo);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(xq + b * kBlock + 16), hi);
  }
}

// T rows of x times one Q8_0 weight column (its nb blocks of 32 int8).
template <int T>
void column_q8_0(const int8_t* q, const at::Half* d, int64_t nb, const Row* x, float* out,
                 int64_t ldo) {
  __m256 acc0[T], acc1[T];
  for (int r = 0; r < T; ++r) acc0[r] = acc1[r] = _mm256_setzero_ps();
  alignas(32) float scale[T][8];
  const auto block = [&](int64_t b, int i, __m256(&acc)[T]) {
    const __m128i* p = reinterpret_cast<const __m128i*>(q + kBlock * b);
    const __m256i lo = _mm256_cvtepi8_epi16(_mm_loadu_si128(p));
    const __m256i hi = _mm256_cvtepi8_epi16(_mm_loadu_si128(p + 1));
    for (int r = 0; r < T; ++r) {
      const int16_t* xb = x[r].xq + kBlock * b;
      const __m256i s = _mm256_add_epi32(
          _mm256_madd_epi16(lo, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xb))),
          _mm256_madd_epi16(hi, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xb + 16))));
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_broadcast_ss(&scale[r][i]), acc[r]);
    }
  };
  for (int64_t b0 = 0; b0 < nb; b0 += 8) {
    const int64_t count = std::min<int64_t>(8, nb - b0);
    const __m256 dv = load_half8(d + b0, count);
    for (int r = 0; r < T; ++r)
      _mm256_store_ps(scale[r], _mm256_mul_ps(dv, _mm256_loadu_ps(x[r].xd + b0)));
    int i = 0;
    for (; i + 2 <= count; i += 2) {
      block(b0 + i, i, acc0);
      block(b0 + i + 1, i + 1, acc1);
    }
    if (i < count) block(b0 + i, i, acc0);
  }
  for (int r = 0; r < T; ++r) out[r * ldo] = hsum8(_mm256_add_ps(acc0[r], acc1[r]));
}

// T rows of x times one weight column (its nb blocks).
template <int T>
void column(const uint8_t* q, const at::Half* d, const at::Half* m, int64_t nb,
            const Row* x, float* out, int64_t ldo) {
  const __m256i mask = _mm256_setr_epi16(15, 15, 15, 15, 15, 15, 15, 15, 0xF00, 0xF00, 0xF00,
                                         0xF00, 0xF00, 0xF00, 0xF00, 0xF00);
  __m256 acc0[T], acc1[T], mterm[T];
  for (int r = 0; r < T; ++r) acc0[r] = acc1[r] = mterm[r] = _mm256_setzero_ps();
  alignas(32) float scale[T][8];
  const auto block = [&](int64_t b, int i, __m256(&acc)[T]) {
    const __m256i v =
        _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 16 * b)));
    const __m256i lo = _mm256_and_si256(v, mask);
    const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), mask);
    for (int r = 0; r < T; ++r) {
      const int16_t* xb = x[r].xq + kBlock * b;
      const __m256i p = _mm256_add_epi32(
          _mm256_madd_epi16(lo, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xb))),
          _mm256_madd_epi16(hi, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xb + 16))));
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_broadcast_ss(&scale[r][i]), acc[r]);
    }
  };
  for (int64_t b0 = 0; b0 < nb; b0 += 8) {
    const int64_t count = std::min<int64_t>(8, nb - b0);
    const __m256 dv = load_half8(d + b0, count), mv = load_half8(m + b0, count);
    for (int r = 0; r < T; ++r) {
      _mm256_store_ps(scale[r], _mm256_mul_ps(dv, _mm256_loadu_ps(x[r].xd + b0)));
      mterm[r] = _mm256_fmadd_ps(mv, _mm256_loadu_ps(x[r].xs + b0), mterm[r]);
    }
    int i = 0;
    for (; i + 2 <= count; i += 2) {
      block(b0 + i, i, acc0);
      block(b0 + i + 1, i + 1, acc1);
    }
    if (i < count) block(b0 + i, i, acc0);
  }
  // Lanes 4..7 summed products of 256 * q.
  const __m256 lane = _mm256_setr_ps(1.f, 1.f, 1.f, 1.f, 1.f / 256, 1.f / 256, 1.f / 256,
                                     1.f / 256);
  for (int r = 0; r < T; ++r)
    out[r * ldo] = hsum8(_mm256_fmadd_ps(_mm256_add_ps(acc0[r], acc1[r]), lane, mterm[r]));
}

}  // namespace i16_avx2
#pragma GCC pop_options
#endif  // AIRSERVE_I16_AVX2

using QuantizeFn = void (*)(const float*, int64_t, int16_t*, float*, float*);

// x must be float32 [M, K], 1 <= M <= kMaxRows, K a multiple of 32; returns {M, K}.
std::pair<int64_t, int64_t> check_x(const at::Tensor& x, const char* name) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), name,
              ": x must be a contiguous float32 [M, K] tensor");
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(M >= 1 && M <= kMaxRows, name, ": at least 1 and at most ", kMaxRows,
              " rows, got ", M);
  TORCH_CHECK(K % kBlock == 0, name, ": K=", K, " is not a multiple of ", kBlock);
  return {M, K};
}

// The [M, N] product: x's rows quantized by `avx2` where `vector` holds and the CPU has AVX2
// (else by `portable`), then column(n, rows, vector, out + n) for every output column n, split
// across torch's threads (out + n is row 0's element; row r's is r * N further).
template <typename Column>
at::Tensor int16_product(const at::Tensor& x, int64_t N, bool vector, QuantizeFn avx2,
                         QuantizeFn portable, Column column) {
  vector = vector && avx2 != nullptr && airserve_int16::avx2_here();
  const int64_t M = x.size(0), K = x.size(1);
  const airserve_int16::QuantizedRows quantized(x.data_ptr<float>(), M, K,
                                                vector ? avx2 : portable);
  const Row* rows = quantized.rows();
  at::Tensor out = at::empty({M, N}, x.options());
  float* o = out.data_ptr<float>();
  at::parallel_for(0, N, kGrain, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) column(n, rows, vector, o + n);
  });
  return out;
}

#ifdef AIRSERVE_I16_AVX2
constexpr QuantizeFn kAvx2Quantize = i16_avx2::quantize_row;
constexpr QuantizeFn kAvx2QuantizeNatural = i16_avx2::quantize_row_natural;
#else
constexpr QuantizeFn kAvx2Quantize = nullptr;
constexpr QuantizeFn kAvx2QuantizeNatural = nullptr;
#endif

at::Tensor q4_1_matmul_i16_impl(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& d,
                                const at::Tensor& m, bool vector) {
  const char* name = "airserve::q4_1_matmul_i16";
  const std::pair<int64_t, int64_t> mk = check_x(x, name);
  const int64_t M = mk.first, K = mk.second;
  const int64_t nb = K / kBlock;
  TORCH_CHECK(qs.dim() == 2 && qs.scalar_type() == at::kByte && qs.size(1) == K / 2 &&
                  qs.is_contiguous(),
              name, ": qs must be contiguous uint8 [N, ", K / 2, "]");
  const int64_t N = qs.size(0);
  for (const at::Tensor* t : {&d, &m})
    TORCH_CHECK(t->dim() == 2 && t->scalar_type() == at::kHalf && t->is_contiguous() &&
                    t->size(0) == N && t->size(1) == nb,
                name, ": d and m must be contiguous float16 [", N, ", ", nb, "]");
  const uint8_t* q = qs.data_ptr<uint8_t>();
  const at::Half* dp = d.data_ptr<at::Half>();
  const at::Half* mp = m.data_ptr<at::Half>();
  return int16_product(x, N, vector, kAvx2Quantize, quantize_row,
                       [&](int64_t n, const Row* rows, bool simd, float* o) {
    const uint8_t* qn = q + n * (K / 2);
    const at::Half *dn = dp + n * nb, *mn = mp + n * nb;
#ifdef AIRSERVE_I16_AVX2
    if (simd) {
      int64_t r = 0;
      for (; r + 2 <= M; r += 2) i16_avx2::column<2>(qn, dn, mn, nb, &rows[r], o + r * N, N);
      if (r < M) i16_avx2::column<1>(qn, dn, mn, nb, &rows[r], o + r * N, N);
      return;
    }
#endif
    for (int64_t r = 0; r < M; ++r) column_portable(qn, dn, mn, nb, rows[r], o + r * N);
  });
}

at::Tensor q8_0_matmul_i16_impl(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& d,
                                bool vector) {
  const char* name = "airserve::q8_0_matmul_i16";
  const std::pair<int64_t, int64_t> mk = check_x(x, name);
  const int64_t M = mk.first, K = mk.second;
  const int64_t nb = K / kBlock;
  TORCH_CHECK(qs.dim() == 2 && qs.scalar_type() == at::kChar && qs.size(1) == K &&
                  qs.is_contiguous(),
              name, ": qs must be contiguous int8 [N, ", K, "]");
  const int64_t N = qs.size(0);
  TORCH_CHECK(d.dim() == 2 && d.scalar_type() == at::kHalf && d.is_contiguous() &&
                  d.size(0) == N && d.size(1) == nb,
              name, ": d must be contiguous float16 [", N, ", ", nb, "]");
  const int8_t* q = qs.data_ptr<int8_t>();
  const at::Half* dp = d.data_ptr<at::Half>();
  return int16_product(x, N, vector, kAvx2QuantizeNatural, quantize_row_natural,
                       [&](int64_t n, const Row* rows, bool simd, float* o) {
    const int8_t* qn = q + n * K;
    const at::Half* dn = dp + n * nb;
#ifdef AIRSERVE_I16_AVX2
    if (simd) {
      int64_t r = 0;
      for (; r + 2 <= M; r += 2) i16_avx2::column_q8_0<2>(qn, dn, nb, &rows[r], o + r * N, N);
      if (r < M) i16_avx2::column_q8_0<1>(qn, dn, nb, &rows[r], o + r * N, N);
      return;
    }
#endif
    for (int64_t r = 0; r < M; ++r) column_portable_q8_0(qn, dn, nb, rows[r], o + r * N);
  });
}

at::Tensor q8_0_matmul_i16(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& d) {
  return q8_0_matmul_i16_impl(x, qs, d, true);
}

at::Tensor q8_0_matmul_i16_portable(const at::Tensor& x, const at::Tensor& qs,
                                    const at::Tensor& d) {
  return q8_0_matmul_i16_impl(x, qs, d, false);
}

at::Tensor q4_1_matmul_i16(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& d,
                           const at::Tensor& m) {
  return q4_1_matmul_i16_impl(x, qs, d, m, true);
}

at::Tensor q4_1_matmul_i16_portable(const at::Tensor& x, const at::Tensor& qs,
                                    const at::Tensor& d, const at::Tensor& m) {
  return q4_1_matmul_i16_impl(x, qs, d, m, false);
}

}  // namespace

TORCH_LIBRARY_IMPL(airserve, CPU, lib) {
  lib.impl("q4_1_matmul_i16", &q4_1_matmul_i16);
  lib.impl("q4_1_matmul_i16_portable", &q4_1_matmul_i16_portable);
  lib.impl("q8_0_matmul_i16", &q8_0_matmul_i16);
  lib.impl("q8_0_matmul_i16_portable", &q8_0_matmul_i16_portable);
}
