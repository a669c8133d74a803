// Paged decode attention on the host CPU, float32: one new token per sequence.
//
// Writes the new token's K/V into the pool at out_cache_loc, then attends each query over the
// first seq_lens[b] positions of its block table (the padded tail is never read). One task per
// (sequence, KV head) reads each cached K/V row once for all query heads of its group. The
// file is built with -march=native (cpu_kernels.py): dot and axpy use AVX-512 or AVX2+FMA when
// the build CPU has them, else plain loops.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

namespace {

inline float dot(const float* a, const float* b, int64_t n) {
  int64_t i = 0;
  float s = 0.f;
#if defined(__AVX512F__)
  __m512 acc = _mm512_setzero_ps();
  for (; i + 16 <= n; i += 16)
    acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc);
  s = _mm512_reduce_add_ps(acc);
#elif defined(__AVX2__) && defined(__FMA__)
  // Two accumulators: a head of 64 values is 8 FMAs, and one chain would wait on each.
  __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
  for (; i + 16 <= n; i += 16) {
    acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc0);
    acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), acc1);
  }
  for (; i + 8 <= n; i += 8)
    acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc0);
  const __m256 acc = _mm256_add_ps(acc0, acc1);
  __m128 half = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
  half = _mm_add_ps(half, _mm_movehl_ps(half, half));
  half = _mm_add_ss(half, _mm_movehdup_ps(half));
  s = _mm_cvtss_f32(half);
#endif
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

inline void axpy(float* y, float alpha, const float* x, int64_t n) {
  int64_t i = 0;
#if defined(__AVX512F__)
  const __m512 a = _mm512_set1_ps(alpha);
  for (; i + 16 <= n; i += 16)
    _mm512_storeu_ps(y + i, _mm512_fmadd_ps(a, _mm512_loadu_ps(x + i), _mm512_loadu_ps(y + i)));
#elif defined(__AVX2__) && defined(__FMA__)
  const __m256 a = _mm256_set1_ps(alpha);
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(y + i, _mm256_fmadd_ps(a, _mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
#endif
  for (; i < n; ++i) y[i] += alpha * x[i];
}

#if defined(__AVX2__) && defined(__FMA__)
// e^x for x <= 0 (softmax scores minus their maximum), 8 lanes: x = n ln2 + r with |r| <= ln2/2,
// e^r from a degree-7 polynomial (Cephes' expf coefficients, relative error ~1e-7), 2^n put
// into the exponent bits. Inputs below -87 give e^-87 (~1.6e-38) instead of denormals.
inline __m256 exp_nonpositive(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  // ln 2 in two parts, so n * ln2 is subtracted without losing r's low bits.
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n),
                                                       _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}
#endif

// s[j] = e^(s[j] - mx) for j < n; returns their sum.
inline float exp_shifted(float* s, int64_t n, float mx) {
  int64_t j = 0;
  float total = 0.f;
#if defined(__AVX2__) && defined(__FMA__)
  const __m256 m = _mm256_set1_ps(mx);
  __m256 acc = _mm256_setzero_ps();
  for (; j + 8 <= n; j += 8) {
    const __m256 e = exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(s + j), m));
    _mm256_storeu_ps(s + j, e);
    acc = _mm256_add_ps(acc, e);
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, acc);
  for (float lane : lanes) total += lane;
#endif
  for (; j < n; ++j) total += (s[j] = std::exp(s[j] - mx));
  return total;
}

at::Tensor paged_decode_attention_cpu(const at::Tensor& q_in, const at::Tensor& k_in,
                                      const at::Tensor& v_in, at::Tensor& k_cache,
                                      at::Tensor& v_cache, const at::Tensor& out_cache_loc,
                                      const at::Tensor& block_table_in,
                                      const at::Tensor& seq_lens_in, int64_t page_size,
                                      double scale) {
  const char* name = "airserve::paged_decode_attention_cpu";
  TORCH_CHECK(q_in.scalar_type() == at::kFloat && k_cache.scalar_type() == at::kFloat &&
                  v_cache.scalar_type() == at::kFloat,
              name, ": float32 queries and KV cache only");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.dim() == 3,
              name, ": the KV buffers must be contiguous [num_slots, KVH, D]");
  const at::Tensor q = q_in.contiguous();
  const at::Tensor k = k_in.to(at::kFloat).contiguous();
  const at::Tensor v = v_in.to(at::kFloat).contiguous();
  const at::Tensor loc = out_cache_loc.to(at::kLong).contiguous();
  const at::Tensor table = block_table_in.to(at::kInt).contiguous();
  const at::Tensor lens = seq_lens_in.to(at::kInt).contiguous();
  const int64_t bs = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t KVH = k_cache.size(1), slots = k_cache.size(0), width = table.size(1);
  TORCH_CHECK(H % KVH == 0 && k_cache.size(2) == D, name, ": head shapes do not match");
  const int64_t group = H / KVH, row = KVH * D;
  float* kc = k_cache.data_ptr<float>();
  float* vc = v_cache.data_ptr<float>();
  const int64_t* locp = loc.data_ptr<int64_t>();
  for (int64_t b = 0; b < bs; ++b) {
    TORCH_CHECK(locp[b] >= 0 && locp[b] < slots, name, ": out_cache_loc out of range");
    std::copy_n(k.data_ptr<float>() + b * row, row, kc + locp[b] * row);
    std::copy_n(v.data_ptr<float>() + b * row, row, vc + locp[b] * row);
  }
  const int32_t* tp = table.data_ptr<int32_t>();
  const int32_t* lp = lens.data_ptr<int32_t>();
  for (int64_t b = 0; b < bs; ++b)
    TORCH_CHECK(lp[b] >= 1 && lp[b] <= width * page_size, name, ": seq_lens[", b, "]=", lp[b],
                " does not fit the block table");
  at::Tensor out = at::zeros({bs, H, D}, q.options());
  const float* qp = q.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float sc = static_cast<float>(scale);
  at::parallel_for(0, bs * KVH, 1, [&](int64_t t0, int64_t t1) {
    std::vector<float> scores;
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t b = t / KVH, h = t % KVH, len = lp[b];
      scores.assign(group * len, 0.f);
      for (int64_t j = 0; j < len; ++j) {
        const int64_t page = tp[b * width + j / page_size];
        const float* kr = kc + (page * page_size + j % page_size) * row + h * D;
        for (int64_t g = 0; g < group; ++g)
          scores[g * len + j] = sc * dot(qp + (b * H + h * group + g) * D, kr, D);
      }
      for (int64_t g = 0; g < group; ++g) {
        float* s = scores.data() + g * len;
        const float mx = *std::max_element(s, s + len);
        const float inv = 1.f / exp_shifted(s, len, mx);
        for (int64_t j = 0; j < len; ++j) s[j] *= inv;
      }
      for (int64_t j = 0; j < len; ++j) {
        const int64_t page = tp[b * width + j / page_size];
        const float* vr = vc + (page * page_size + j % page_size) * row + h * D;
        for (int64_t g = 0; g < group; ++g)
          axpy(op + (b * H + h * group + g) * D, scores[g * len + j], vr, D);
      }
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(airserve, CPU, lib) {
  lib.impl("paged_decode_attention_cpu", &paged_decode_attention_cpu);
}
