// Matrix products of float32 activations with GGML block-quantized weights, for decode.
//
// Weights stay in the GGUF block layout (ggml-common.h): every row of a [N, K] weight is K/32
// blocks of 32 values with fp16 scales. Each product is computed in float32 from the exact
// block values, so the result equals x @ dequantize(w).T up to summation order.
//   Q4_1: value[j] = d * q[j] + m, q[j] 4-bit; byte j of a block holds q[j] (low nibble) and
//         q[j + 16] (high nibble).          qs: uint8 [N, K/2], d, m: float16 [N, K/32]
//   Q8_0: value[j] = d * q[j], q[j] int8.  qs: int8 [N, K],    d: float16 [N, K/32]
// Every weight block is unpacked once and used for all M rows of x, so a small batch costs
// about as much as one row: the weights are read once per step, at a quarter (Q4_1) or a
// third (Q8_0) of the bytes of float32.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <cstdint>

#if defined(__AVX512F__) || defined(__F16C__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kBlock = 32;

// c10::Half's portable conversion costs ~20 instructions; F16C does it in one.
inline float to_float(at::Half h) {
#if defined(__F16C__)
  return _cvtsh_ss(h.x);
#else
  return static_cast<float>(h);
#endif
}
constexpr int64_t kMaxRows = 16;

void check_inputs(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& d,
                  int64_t packed_per_row, const char* name) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              name, ": x must be a contiguous float32 [M, K] tensor");
  TORCH_CHECK(x.size(0) <= kMaxRows, name, ": at most ", kMaxRows, " rows, got ", x.size(0));
  const int64_t K = x.size(1);
  TORCH_CHECK(K % kBlock == 0, name, ": K=", K, " is not a multiple of ", kBlock);
  TORCH_CHECK(qs.dim() == 2 && qs.size(1) == K / kBlock * packed_per_row && qs.is_contiguous(),
              name, ": qs must be contiguous [N, ", K / kBlock * packed_per_row, "]");
  TORCH_CHECK(d.scalar_type() == at::kHalf && d.is_contiguous() && d.dim() == 2 &&
                  d.size(0) == qs.size(0) && d.size(1) == K / kBlock,
              name, ": d must be contiguous float16 [N, K/32]");
}

// One output row of Q4_1 for M rows of x: acc[r] = sum over blocks of d*(x.q) + m*sum(x).
// M is a template parameter so the accumulators live in registers; the low and high halves of
// a block go to separate accumulators, two independent FMA chains per row.
template <int M>
inline void q4_1_row(const float* x, const float* xsum, int64_t K, const uint8_t* q,
                     const at::Half* d, const at::Half* m, float* acc) {
  const int64_t nb = K / kBlock;
#if defined(__AVX512F__)
  __m512 acc_lo[M], acc_hi[M];
  for (int r = 0; r < M; ++r) acc_lo[r] = acc_hi[r] = _mm512_setzero_ps();
  const __m512i low4 = _mm512_set1_epi32(15);
  for (int64_t b = 0; b < nb; ++b) {
    const __m512i bytes = _mm512_cvtepu8_epi32(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + b * 16)));
    const __m512 dv = _mm512_set1_ps(to_float(d[b]));
    const __m512 lo = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_and_si512(bytes, low4)), dv);
    const __m512 hi = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(bytes, 4)), dv);
    for (int r = 0; r < M; ++r) {
      const float* xb = x + r * K + b * kBlock;
      acc_lo[r] = _mm512_fmadd_ps(_mm512_loadu_ps(xb), lo, acc_lo[r]);
      acc_hi[r] = _mm512_fmadd_ps(_mm512_loadu_ps(xb + 16), hi, acc_hi[r]);
    }
  }
  // The m term, 16 blocks at a time: sum over b of m[b] * xsum[r, b].
  for (int64_t b0 = 0; b0 < nb; b0 += 16) {
    const __mmask16 mask = nb - b0 >= 16 ? 0xFFFF : (1u << (nb - b0)) - 1;
    const __m512 mv = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, m + b0));
    for (int r = 0; r < M; ++r)
      acc_lo[r] = _mm512_fmadd_ps(mv, _mm512_maskz_loadu_ps(mask, xsum + r * nb + b0), acc_lo[r]);
  }
  for (int r = 0; r < M; ++r) acc[r] = _mm512_reduce_add_ps(_mm512_add_ps(acc_lo[r], acc_hi[r]));
#else
  for (int r = 0; r < M; ++r) acc[r] = 0.f;
  for (int64_t b = 0; b < nb; ++b) {
    const float dd = to_float(d[b]);
    float lo[16], hi[16];
    for (int j = 0; j < 16; ++j) {
      lo[j] = static_cast<float>(q[b * 16 + j] & 15) * dd;
      hi[j] = static_cast<float>(q[b * 16 + j] >> 4) * dd;
    }
    for (int r = 0; r < M; ++r) {
      const float* xb = x + r * K + b * kBlock;
      float s = 0.f;
      for (int j = 0; j < 16; ++j) s += xb[j] * lo[j] + xb[16 + j] * hi[j];
      acc[r] += s;
    }
  }
  for (int r = 0; r < M; ++r) {
    float s = 0.f;
    for (int64_t b = 0; b < nb; ++b) s += to_float(m[b]) * xsum[r * nb + b];
    acc[r] += s;
  }
#endif
}

// One output row of Q8_0 for M rows of x: acc[r] = sum over blocks of d*(x.q).
template <int M>
inline void q8_0_row(const float* x, const float* /*xsum*/, int64_t K, const int8_t* q,
                     const at::Half* d, const at::Half* /*m*/, float* acc) {
  const int64_t nb = K / kBlock;
#if defined(__AVX512F__)
  __m512 acc0[M], acc1[M];
  for (int r = 0; r < M; ++r) acc0[r] = acc1[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const __m512 dv = _mm512_set1_ps(to_float(d[b]));
    const int8_t* qb = q + b * kBlock;
    const __m512 w0 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(qb)))), dv);
    const __m512 w1 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(qb + 16)))), dv);
    for (int r = 0; r < M; ++r) {
      const float* xb = x + r * K + b * kBlock;
      acc0[r] = _mm512_fmadd_ps(_mm512_loadu_ps(xb), w0, acc0[r]);
      acc1[r] = _mm512_fmadd_ps(_mm512_loadu_ps(xb + 16), w1, acc1[r]);
    }
  }
  for (int r = 0; r < M; ++r) acc[r] = _mm512_reduce_add_ps(_mm512_add_ps(acc0[r], acc1[r]));
#else
  for (int r = 0; r < M; ++r) acc[r] = 0.f;
  for (int64_t b = 0; b < nb; ++b) {
    const float dd = to_float(d[b]);
    for (int r = 0; r < M; ++r) {
      const float* xb = x + r * K + b * kBlock;
      float s = 0.f;
      for (int j = 0; j < kBlock; ++j) s += xb[j] * static_cast<float>(q[b * kBlock + j]);
      acc[r] += s * dd;
    }
  }
#endif
}

// Runs Row<M> over output rows [n0, n1) for the runtime M (1..kMaxRows).
template <template <int> class Row, typename Q>
void run_rows(int64_t M, int64_t n0, int64_t n1, int64_t N, int64_t K, int64_t q_stride,
              const float* x, const float* xsum, const Q* q, const at::Half* d,
              const at::Half* m, float* out) {
  float acc[kMaxRows];
  auto loop = [&](auto row) {
    for (int64_t n = n0; n < n1; ++n) {
      const int64_t nb = K / kBlock;
      row(x, xsum, K, q + n * q_stride, d + n * nb, m ? m + n * nb : nullptr, acc);
      for (int64_t r = 0; r < M; ++r) out[r * N + n] = acc[r];
    }
  };
  switch (M) {
#define AIRSERVE_ROWS_CASE(R) \
    case R: loop(Row<R>::run); break;
    AIRSERVE_ROWS_CASE(1) AIRSERVE_ROWS_CASE(2) AIRSERVE_ROWS_CASE(3) AIRSERVE_ROWS_CASE(4)
    AIRSERVE_ROWS_CASE(5) AIRSERVE_ROWS_CASE(6) AIRSERVE_ROWS_CASE(7) AIRSERVE_ROWS_CASE(8)
    AIRSERVE_ROWS_CASE(9) AIRSERVE_ROWS_CASE(10) AIRSERVE_ROWS_CASE(11) AIRSERVE_ROWS_CASE(12)
    AIRSERVE_ROWS_CASE(13) AIRSERVE_ROWS_CASE(14) AIRSERVE_ROWS_CASE(15) AIRSERVE_ROWS_CASE(16)
#undef AIRSERVE_ROWS_CASE
    default: TORCH_CHECK(false, "airserve block matmul: unsupported row count ", M);
  }
}

template <int M>
struct Q4_1Row {
  static void run(const float* x, const float* xsum, int64_t K, const uint8_t* q,
                  const at::Half* d, const at::Half* m, float* acc) {
    q4_1_row<M>(x, xsum, K, q, d, m, acc);
  }
};

template <int M>
struct Q8_0Row {
  static void run(const float* x, const float* xsum, int64_t K, const int8_t* q,
                  const at::Half* d, const at::Half* m, float* acc) {
    q8_0_row<M>(x, xsum, K, q, d, m, acc);
  }
};

// Output rows are split across torch's intra-op threads in chunks of at least this many.
constexpr int64_t kGrain = 32;

at::Tensor q4_1_matmul(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& d,
                       const at::Tensor& m) {
  check_inputs(x, qs, d, 16, "airserve::q4_1_matmul");
  TORCH_CHECK(qs.scalar_type() == at::kByte, "airserve::q4_1_matmul: qs must be uint8");
  TORCH_CHECK(m.sizes() == d.sizes() && m.scalar_type() == at::kHalf && m.is_contiguous(),
              "airserve::q4_1_matmul: m must be contiguous float16 like d");
  const int64_t M = x.size(0), K = x.size(1), N = qs.size(0), nb = K / kBlock;
  at::Tensor out = at::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  // Block sums of x, for the `m` term: [M, K/32] (a few hundred floats, on the stack).
  TORCH_CHECK(M * nb <= 16 * 1024, "airserve::q4_1_matmul: K too large");
  float xsum[16 * 1024];
  for (int64_t i = 0; i < M * nb; ++i) {
    float s = 0.f;
    for (int64_t j = 0; j < kBlock; ++j) s += xp[i * kBlock + j];
    xsum[i] = s;
  }
  const float* sp = xsum;
  const uint8_t* qp = qs.data_ptr<uint8_t>();
  const at::Half* dp = d.data_ptr<at::Half>();
  const at::Half* mp = m.data_ptr<at::Half>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, N, kGrain, [&](int64_t n0, int64_t n1) {
    run_rows<Q4_1Row>(M, n0, n1, N, K, K / 2, xp, sp, qp, dp, mp, op);
  });
  return out;
}

at::Tensor q8_0_matmul(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& d) {
  check_inputs(x, qs, d, kBlock, "airserve::q8_0_matmul");
  TORCH_CHECK(qs.scalar_type() == at::kChar, "airserve::q8_0_matmul: qs must be int8");
  const int64_t M = x.size(0), K = x.size(1), N = qs.size(0), nb = K / kBlock;
  at::Tensor out = at::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const int8_t* qp = qs.data_ptr<int8_t>();
  const at::Half* dp = d.data_ptr<at::Half>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, N, kGrain, [&](int64_t n0, int64_t n1) {
    run_rows<Q8_0Row>(M, n0, n1, N, K, K, xp, nullptr, qp, dp, nullptr, op);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(airserve, CPU, lib) {
  lib.impl("q4_1_matmul", &q4_1_matmul);
  lib.impl("q8_0_matmul", &q8_0_matmul);
}
