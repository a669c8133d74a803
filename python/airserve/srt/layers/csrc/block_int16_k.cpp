// Q4_K and Q6_K products with int16 activations, for decode (at most 16 rows).
//
// Each row of x is quantized per block of 32 to int16, as for Q4_1 (block_int16.cpp): xd =
// max|x| / 32767, xq = round(x / xd), an error of at most xd / 2 per activation. A K-quant
// super-block of 256 values is eight such blocks (ggml-common.h's block_q4_K / block_q6_K):
//   Q4_K: value = d * sc[j] * q - dmin * mn[j], q 4-bit, j the block of 32 (6-bit sc, mn);
//   Q6_K: value = d * sc[i] * (q - 32), q 6-bit, i the sub-block of 16 (int8 sc).
// So a block of 32's product is a * xd * sum(q' * xq) + c * sum(x), with the integer sum
// exact: Q4_K q' = q (a = d * sc[j], c = -dmin * mn[j]); Q6_K q' = q - 32, one sum per
// sub-block of 16 (a = d * sc[i], c = 0; the AVX2 loop keeps the two sub-blocks of a block in
// separate int32 lanes and scales them in float32). The AVX2 loops' int32 lanes stay below 2^22.
//
// Why: the float32 products of these kinds widen every value to float before its FMA. On a
// 2-core AMD EPYC with AVX2 only (Zen 3) they ran at 3-6 GB/s of weights on one thread
// (bench_kernels.py, [576, 1536], one row: Q4_K 112-164 us, Q6_K 115 us; int16 here: 50 and
// 66 us; Q4_1's int16 product of the same shape 42 us), and the int8 products (block_int8.cpp)
// unpack each super-block to bytes through memory first and were no faster. Q6_K's first loop
// multiplied its scales into the 16-bit values (vpmullw): 78 us. A Q4_K_M file's ffn_down layers are these
// kinds (most of its other layers are Q5_0 and Q8_0 on this 576-wide model).
//
// The AVX2 loops take the weight bytes as 16-bit lanes: lane i of 32 bytes holds bytes 2i and
// 2i + 1, so shifts and masks give value 2i and value 2i + 1 of a block in separate registers.
// The activations are stored in that order per block, [x0 x2 .. x30 | x1 x3 .. x31] (slot_of),
// and one vpmaddwd per 16 values pairs them up.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>

#if (defined(__x86_64__) || defined(_M_X64)) && defined(__GNUC__) && !defined(__clang__)
#include <immintrin.h>
#define AIRSERVE_I16K_AVX2 1
#endif

#include "block_unpack.h"
#include "cpu_common.h"
#include "int16_rows.h"

namespace {

using airserve_blocks::Kind;

using airserve_int16::kBlock;
constexpr int64_t kSuper = 256;
constexpr int64_t kMaxRows = 16;
constexpr int64_t kGrain = 16;  // output columns per parallel task, at least
constexpr int64_t kPrefetchColumns = 8;

using airserve_int16::Row;  // a quantized row, xq in slot_of's order

// Where value j of a block of 32 sits in the quantized row: evens first, then odds.
inline int slot_of(int j) { return (j % 2) * 16 + j / 2; }

void quantize_row(const float* x, int64_t K, int16_t* xq, float* xd, float* xs) {
  airserve_int16::quantize_row_portable(x, K, xq, xd, xs, slot_of);
}

// Plain C++ (any CPU, and the tests' second opinion): the weight unpacked by block_unpack.h
// (value = a[b] * s16[e / 16] * q[e] + c[b]), the same integer sums per block.
void column_portable(const airserve_blocks::Row& w, int64_t nb, const Row& x, float* out) {
  airserve_blocks::Group g;
  float acc = 0.f;
  for (int64_t gi = 0; gi * 8 < nb; ++gi) {
    airserve_blocks::unpack(w, gi, nb, g);
    const uint8_t* uq = reinterpret_cast<const uint8_t*>(g.q);
    for (int b = 0; b < g.nblocks; ++b) {
      const int64_t bi = gi * 8 + b;
      const int16_t* xb = x.xq + bi * kBlock;
      // 64-bit: a Q6_K block's sum reaches 32 * 32 * 128 * 32767 = 2^32 (the AVX2 loop's
      // int32 lanes hold 4 values each, 2^29 at most).
      int64_t s = 0;
      for (int h = 0; h < 2; ++h) {
        int64_t t = 0;
        for (int j = 16 * h; j < 16 * h + 16; ++j) {
          const int32_t q = g.is_signed ? int32_t(g.q[32 * b + j]) : int32_t(uq[32 * b + j]);
          t += q * xb[slot_of(j)];
        }
        s += t * g.s16[2 * b + h];
      }
      acc += g.a[b] * x.xd[bi] * static_cast<float>(s) + g.c[b] * x.xs[bi];
    }
  }
  *out = acc;
}

#ifdef AIRSERVE_I16K_AVX2
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
namespace i16k_avx2 {

using airserve_int16::hsum8;

// quantize_row's values (int16_rows.h): two cross-half permutes put the block's 16 evens and
// 16 odds each in one register.
void quantize_row(const float* x, int64_t K, int16_t* xq, float* xd, float* xs) {
  for (int64_t b = 0; b < K / kBlock; ++b) {
    __m256i lo, hi;  // [evens of 0..15 | odds of 0..15], the same for 16..31
    airserve_int16::quantize_block_avx2(x + b * kBlock, &lo, &hi, xd + b, xs + b);
    int16_t* o = xq + b * kBlock;
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(o), _mm256_permute2x128_si256(lo, hi, 0x20));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + 16),
                        _mm256_permute2x128_si256(lo, hi, 0x31));
  }
}

inline uint32_t load_u32(const uint8_t* p) {
  uint32_t u;
  std::memcpy(&u, p, 4);
  return u;
}

inline uint16_t load_u16(const uint8_t* p) {
  uint16_t u;
  std::memcpy(&u, p, 2);
  return u;
}

// Eight unsigned bytes (lo's four, then hi's) as float32.
inline __m256 bytes_to_float(uint32_t lo, uint32_t hi) {
  return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_set_epi32(0, 0, static_cast<int>(hi),
                                                               static_cast<int>(lo))));
}

inline __m256i load32(const void* p) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
}

// Block b of row r times evens e and odds o (16-bit weights in value order 2i / 2i + 1),
// added to acc at the block's float scale.
template <int T>
inline void block_fma(__m256i e, __m256i o, const Row* x, int64_t b, const float (*scale)[8],
                      int i, __m256 (&acc)[T]) {
  for (int r = 0; r < T; ++r) {
    const int16_t* xb = x[r].xq + kBlock * b;
    const __m256i p = _mm256_add_epi32(_mm256_madd_epi16(e, load32(xb)),
                                       _mm256_madd_epi16(o, load32(xb + 16)));
    acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_broadcast_ss(&scale[r][i]), acc[r]);
  }
}

// T rows of x times one Q4_K weight column (nsb super-blocks of 144 bytes).
template <int T>
void column_q4_k(const uint8_t* w, int64_t nsb, const Row* x, float* out, int64_t ldo) {
  const __m256i nib = _mm256_set1_epi16(15);
  __m256 acc0[T], acc1[T], mterm[T];
  for (int r = 0; r < T; ++r) acc0[r] = acc1[r] = mterm[r] = _mm256_setzero_ps();
  alignas(32) float scale[T][8];
  for (int64_t sb = 0; sb < nsb; ++sb) {
    const uint8_t* p = w + sb * 144;
    // d and dmin (two fp16), and the eight 6-bit scales and minimums of scale_min_k4 from the
    // 12 bytes after them, four at a time in 32-bit words.
    const __m128 dd = _mm_cvtph_ps(_mm_cvtsi32_si128(load_u32(p)));
    const uint32_t u0 = load_u32(p + 4), u1 = load_u32(p + 8), u2 = load_u32(p + 12);
    const uint32_t sc_lo = u0 & 0x3F3F3F3Fu, mn_lo = u1 & 0x3F3F3F3Fu;
    const uint32_t sc_hi = (u2 & 0x0F0F0F0Fu) | (((u0 >> 6) & 0x03030303u) << 4);
    const uint32_t mn_hi = ((u2 >> 4) & 0x0F0F0F0Fu) | (((u1 >> 6) & 0x03030303u) << 4);
    const __m256 av = _mm256_mul_ps(_mm256_broadcastss_ps(dd), bytes_to_float(sc_lo, sc_hi));
    const __m256 cv = _mm256_mul_ps(_mm256_broadcastss_ps(_mm_movehdup_ps(dd)),
                                    bytes_to_float(mn_lo, mn_hi));
    for (int r = 0; r < T; ++r) {
      _mm256_store_ps(scale[r], _mm256_mul_ps(av, _mm256_loadu_ps(x[r].xd + 8 * sb)));
      mterm[r] = _mm256_fnmadd_ps(cv, _mm256_loadu_ps(x[r].xs + 8 * sb), mterm[r]);
    }
    const uint8_t* ql = p + 16;
    for (int k = 0; k < 4; ++k) {  // 32 bytes: block 2k in the low nibbles, 2k + 1 in the high
      const __m256i v = load32(ql + 32 * k);
      const __m256i e0 = _mm256_and_si256(v, nib);
      const __m256i o0 = _mm256_and_si256(_mm256_srli_epi16(v, 8), nib);
      const __m256i e1 = _mm256_and_si256(_mm256_srli_epi16(v, 4), nib);
      const __m256i o1 = _mm256_srli_epi16(v, 12);
      block_fma<T>(e0, o0, x, 8 * sb + 2 * k, scale, 2 * k, acc0);
      block_fma<T>(e1, o1, x, 8 * sb + 2 * k + 1, scale, 2 * k + 1, acc1);
    }
  }
  for (int r = 0; r < T; ++r) out[r * ldo] = hsum8(_mm256_add_ps(_mm256_add_ps(acc0[r], acc1[r]),
                                                                mterm[r]));
}

// T rows of x times one Q6_K weight column (nsb super-blocks of 210 bytes). The per-16 scales
// apply in float32: a block of 32's int32 lanes 0..3 sum values 0..15 (sub-block 2 g of the
// half), lanes 4..7 values 16..31, so each block takes one vector of scales [s, s, s, s, t, t,
// t, t] (a permutation of the super-block's d * sc) times its activations' xd.
template <int T>
void column_q6_k(const uint8_t* w, int64_t nsb, const Row* x, float* out, int64_t ldo) {
  const __m256i low4 = _mm256_set1_epi8(0x0F), bits45 = _mm256_set1_epi8(0x30);
  const __m256i byte = _mm256_set1_epi16(0xFF), bias = _mm256_set1_epi16(32);
  const __m256i pick[4] = {_mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1),
                           _mm256_setr_epi32(2, 2, 2, 2, 3, 3, 3, 3),
                           _mm256_setr_epi32(4, 4, 4, 4, 5, 5, 5, 5),
                           _mm256_setr_epi32(6, 6, 6, 6, 7, 7, 7, 7)};
  __m256 acc0[T], acc1[T];
  for (int r = 0; r < T; ++r) acc0[r] = acc1[r] = _mm256_setzero_ps();
  for (int64_t sb = 0; sb < nsb; ++sb) {
    const uint8_t* p = w + sb * 210;
    const __m256 dv = _mm256_broadcastss_ps(
        _mm_cvtph_ps(_mm_cvtsi32_si128(static_cast<int>(load_u16(p + 208)))));
    const __m128i sc = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 192));
    const __m256 ds[2] = {
        _mm256_mul_ps(dv, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sc))),
        _mm256_mul_ps(dv, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(sc, 8))))};
    for (int h = 0; h < 2; ++h) {  // 128 values: ql bytes 64 h .. 64 h + 63, qh 32 h .. + 31
      const __m256i la = load32(p + 64 * h), lb = load32(p + 64 * h + 32);
      const __m256i hb = load32(p + 128 + 32 * h);
      // The four blocks of 32 as bytes 0..63, value order (dequantize_row_q6_K's q1 .. q4).
      const __m256i q[4] = {
          _mm256_or_si256(_mm256_and_si256(la, low4),
                          _mm256_and_si256(_mm256_slli_epi16(hb, 4), bits45)),
          _mm256_or_si256(_mm256_and_si256(lb, low4),
                          _mm256_and_si256(_mm256_slli_epi16(hb, 2), bits45)),
          _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(la, 4), low4),
                          _mm256_and_si256(hb, bits45)),
          _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(lb, 4), low4),
                          _mm256_and_si256(_mm256_srli_epi16(hb, 2), bits45))};
      for (int g = 0; g < 4; ++g) {
        const int64_t b = 8 * sb + 4 * h + g;
        const __m256 s = _mm256_permutevar8x32_ps(ds[h], pick[g]);
        const __m256i e = _mm256_sub_epi16(_mm256_and_si256(q[g], byte), bias);
        const __m256i o = _mm256_sub_epi16(_mm256_srli_epi16(q[g], 8), bias);
        __m256(&acc)[T] = g % 2 == 0 ? acc0 : acc1;
        for (int r = 0; r < T; ++r) {
          const int16_t* xb = x[r].xq + kBlock * b;
          const __m256i i32 = _mm256_add_epi32(_mm256_madd_epi16(e, load32(xb)),
                                               _mm256_madd_epi16(o, load32(xb + 16)));
          acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i32),
                                   _mm256_mul_ps(s, _mm256_broadcast_ss(x[r].xd + b)), acc[r]);
        }
      }
    }
  }
  for (int r = 0; r < T; ++r) out[r * ldo] = hsum8(_mm256_add_ps(acc0[r], acc1[r]));
}

}  // namespace i16k_avx2
#pragma GCC pop_options
#endif  // AIRSERVE_I16K_AVX2

Kind kind_of(const std::string& kind, const char* name) {
  if (kind == "q4_k") return airserve_blocks::kQ4_K;
  if (kind == "q6_k") return airserve_blocks::kQ6_K;
  TORCH_CHECK(false, name, ": int16 activations take q4_k or q6_k blocks here (q4_1: "
              "q4_1_matmul_i16), not '", kind, "'");
  return airserve_blocks::kQ4_K;
}

at::Tensor block_matmul_i16_impl(const at::Tensor& x, const std::string& kind_name,
                                 const at::Tensor& qs, bool vector) {
  const char* name = "airserve::block_matmul_i16";
  const Kind kind = kind_of(kind_name, name);
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), name,
              ": x must be a contiguous float32 [M, K] tensor");
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(M >= 1 && M <= kMaxRows, name, ": at least 1 and at most ", kMaxRows,
              " rows, got ", M);
  TORCH_CHECK(K % kSuper == 0, name, ": K=", K, " is not a multiple of ", kSuper, " (", kind_name,
              " super-blocks)");
  const int64_t nsb = K / kSuper, nb = K / kBlock;
  const int64_t stride = nsb * airserve_blocks::raw_layout(kind).bytes;
  TORCH_CHECK(qs.dim() == 2 && qs.scalar_type() == at::kByte && qs.size(1) == stride &&
                  qs.is_contiguous(),
              name, ": qs must be contiguous uint8 [N, ", stride, "] (", kind_name, " blocks of ",
              K, " values)");
  const int64_t N = qs.size(0);
#ifdef AIRSERVE_I16K_AVX2
  vector = vector && airserve_int16::avx2_here();
  const auto quantize = vector ? i16k_avx2::quantize_row : quantize_row;
#else
  vector = false;
  const auto quantize = quantize_row;
#endif
  const airserve_int16::QuantizedRows quantized(x.data_ptr<float>(), M, K, quantize);
  const Row* rows = quantized.rows();
  at::Tensor out = at::empty({M, N}, x.options());
  float* o = out.data_ptr<float>();
  const uint8_t* q = qs.data_ptr<uint8_t>();
  at::parallel_for(0, N, kGrain, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) {
      const uint8_t* qn = q + n * stride;
      if (n + kPrefetchColumns < n1) {
        const char* ahead = reinterpret_cast<const char*>(qn + kPrefetchColumns * stride);
        for (int64_t off = 0; off < stride; off += 64) __builtin_prefetch(ahead + off, 0, 3);
      }
#ifdef AIRSERVE_I16K_AVX2
      if (vector) {
        int64_t r = 0;
        if (kind == airserve_blocks::kQ4_K) {
          for (; r + 2 <= M; r += 2)
            i16k_avx2::column_q4_k<2>(qn, nsb, &rows[r], o + r * N + n, N);
          if (r < M) i16k_avx2::column_q4_k<1>(qn, nsb, &rows[r], o + r * N + n, N);
        } else {
          for (; r + 2 <= M; r += 2)
            i16k_avx2::column_q6_k<2>(qn, nsb, &rows[r], o + r * N + n, N);
          if (r < M) i16k_avx2::column_q6_k<1>(qn, nsb, &rows[r], o + r * N + n, N);
        }
        continue;
      }
#endif
      const airserve_blocks::Row w{kind, qn, nullptr, nullptr};
      for (int64_t r = 0; r < M; ++r) column_portable(w, nb, rows[r], o + r * N + n);
    }
  });
  return out;
}

at::Tensor block_matmul_i16(const at::Tensor& x, const std::string& kind, const at::Tensor& qs) {
  return block_matmul_i16_impl(x, kind, qs, true);
}

at::Tensor block_matmul_i16_portable(const at::Tensor& x, const std::string& kind,
                                     const at::Tensor& qs) {
  return block_matmul_i16_impl(x, kind, qs, false);
}

}  // namespace

TORCH_LIBRARY_IMPL(airserve, CPU, lib) {
  lib.impl("block_matmul_i16", &block_matmul_i16);
  lib.impl("block_matmul_i16_portable", &block_matmul_i16_portable);
}
