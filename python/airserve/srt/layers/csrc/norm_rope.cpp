// RMSNorm and the rotary embedding of an eager (prefill) pass as one C++ pass each, float32.
//
// In a prefill of 512 tokens the eager torch ops of these two cost ~40 ms a step on a 2-core
// AMD EPYC (pow, mean, add, rsqrt, two products for each norm; float, chunk, cat, two products
// and a sum for each rotation, 60 norms and 60 rotations a step), against ~150 ms for all the
// step's matmuls. Compiled decode graphs fuse the same ops themselves and keep them.
//
// The arithmetic is torch's, in its order, products and sums rounded one at a time (no fused
// multiply-add): rms_norm is w * (x * (1 / sqrt(mean(x^2) + eps))), where only the sum of
// squares is added in another order; rotary is x * cos + swap_halves(x) * sin, bit for bit
// torch's (the tables of models/llama.RotaryEmbedding).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <vector>

#include "cpu_common.h"

#if (defined(__x86_64__) || defined(_M_X64)) && defined(__GNUC__) && !defined(__clang__)
#include <immintrin.h>
#define AIRSERVE_NORM_AVX2 1
#endif

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC optimize("fp-contract=off")
#endif

namespace {

void rms_row_portable(const float* x, const float* w, float* out, int64_t d, float eps) {
  float ss = 0.f;
  for (int64_t j = 0; j < d; ++j) ss += x[j] * x[j];
  const float r = 1.f / std::sqrt(ss / static_cast<float>(d) + eps);
  for (int64_t j = 0; j < d; ++j) out[j] = w[j] * (x[j] * r);
}

void rotate_portable(const float* x, const float* cos, const float* sin, float* out, int64_t d) {
  const int64_t h = d / 2;
  for (int64_t j = 0; j < h; ++j) out[j] = x[j] * cos[j] + x[j + h] * sin[j];
  for (int64_t j = h; j < d; ++j) out[j] = x[j] * cos[j] + x[j - h] * sin[j];
}

#ifdef AIRSERVE_NORM_AVX2
#pragma GCC push_options
#pragma GCC target("avx2,fma")
namespace norm_avx2 {

inline float hsum(__m256 a) {
  __m128 h = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  h = _mm_add_ps(h, _mm_movehl_ps(h, h));
  return _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)));
}

void rms_row(const float* x, const float* w, float* out, int64_t d, float eps) {
  if (d % 8 != 0) return rms_row_portable(x, w, out, d, eps);
  __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
  int64_t j = 0;
  for (; j + 16 <= d; j += 16) {
    const __m256 u = _mm256_loadu_ps(x + j), v = _mm256_loadu_ps(x + j + 8);
    a0 = _mm256_add_ps(a0, _mm256_mul_ps(u, u));
    a1 = _mm256_add_ps(a1, _mm256_mul_ps(v, v));
  }
  for (; j < d; j += 8) {
    const __m256 u = _mm256_loadu_ps(x + j);
    a0 = _mm256_add_ps(a0, _mm256_mul_ps(u, u));
  }
  const float r = 1.f / std::sqrt(hsum(_mm256_add_ps(a0, a1)) / static_cast<float>(d) + eps);
  const __m256 rv = _mm256_set1_ps(r);
  for (j = 0; j < d; j += 8)
    _mm256_storeu_ps(out + j, _mm256_mul_ps(_mm256_loadu_ps(w + j),
                                            _mm256_mul_ps(_mm256_loadu_ps(x + j), rv)));
}

void rotate(const float* x, const float* cos, const float* sin, float* out, int64_t d) {
  const int64_t h = d / 2;
  if (h % 8 != 0) return rotate_portable(x, cos, sin, out, d);
  for (int64_t j = 0; j < h; j += 8) {
    const __m256 lo = _mm256_loadu_ps(x + j), hi = _mm256_loadu_ps(x + j + h);
    _mm256_storeu_ps(out + j, _mm256_add_ps(_mm256_mul_ps(lo, _mm256_loadu_ps(cos + j)),
                                            _mm256_mul_ps(hi, _mm256_loadu_ps(sin + j))));
    _mm256_storeu_ps(out + j + h,
                     _mm256_add_ps(_mm256_mul_ps(hi, _mm256_loadu_ps(cos + j + h)),
                                   _mm256_mul_ps(lo, _mm256_loadu_ps(sin + j + h))));
  }
}

}  // namespace norm_avx2
#pragma GCC pop_options
#endif  // AIRSERVE_NORM_AVX2

// x [T, D] -> w * (x * rsqrt(mean(x^2) + eps)), float32, or rounded to bf16 as torch rounds
// (rms_norm(x).to(bfloat16), bit for bit) when `bf16_out`, for a product that multiplies in
// bf16: each row is then normalized into a float32 row that stays in L1 and leaves as bf16, so
// the float32 [T, D] result is not written and read back to be cast.
at::Tensor rms_norm_impl(const at::Tensor& x, const at::Tensor& weight, double eps, bool vector,
                         bool bf16_out, const char* name) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, name,
              ": x must be float32 [tokens, dim], got ", x.scalar_type(), " ", x.sizes());
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(1) &&
                  weight.scalar_type() == at::kFloat,
              name, ": weight must be float32 [", x.size(1), "]");
  const at::Tensor in = x.contiguous(), w = weight.contiguous();
  const int64_t t = in.size(0), d = in.size(1);
  at::Tensor out = at::empty({t, d}, in.options().dtype(bf16_out ? at::kBFloat16 : at::kFloat));
  const float* xp = in.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  const float e = static_cast<float>(eps);
  vector = vector && airserve_cpu::has_avx2_fma();
  const auto row = [&](int64_t r, float* to) {
#ifdef AIRSERVE_NORM_AVX2
    if (vector) return norm_avx2::rms_row(xp + r * d, wp, to, d, e);
#endif
    rms_row_portable(xp + r * d, wp, to, d, e);
  };
  if (!bf16_out) {
    float* op = out.data_ptr<float>();
    airserve_cpu::for_each_row(t, d, [&](int64_t r) { row(r, op + r * d); });
    return out;
  }
  auto* op = reinterpret_cast<uint16_t*>(out.data_ptr<c10::BFloat16>());
  at::parallel_for(0, t, airserve_cpu::grain_rows(d), [&](int64_t r0, int64_t r1) {
    std::vector<float> normed(d);
    for (int64_t r = r0; r < r1; ++r) {
      row(r, normed.data());
      airserve_cpu::f32_to_bf16(normed.data(), op + r * d, d);
    }
  });
  return out;
}

// x [T, H, D] (any strides but the last) rotated by cos/sin [T, D]: a new [T, H, D] tensor.
at::Tensor rotary_impl(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                       bool vector) {
  TORCH_CHECK(x.dim() == 3 && x.scalar_type() == at::kFloat && x.size(2) % 2 == 0,
              "airserve::rotary: x must be float32 [tokens, heads, dim] with an even dim, got ",
              x.scalar_type(), " ", x.sizes());
  const int64_t t = x.size(0), heads = x.size(1), d = x.size(2);
  for (const at::Tensor* table : {&cos, &sin})
    TORCH_CHECK(table->dim() == 2 && table->size(0) == t && table->size(1) == d &&
                    table->scalar_type() == at::kFloat,
                "airserve::rotary: cos and sin must be float32 [", t, ", ", d, "], got ",
                table->sizes());
  const at::Tensor in = x.stride(2) == 1 ? x : x.contiguous();
  const at::Tensor c = cos.contiguous(), s = sin.contiguous();
  at::Tensor out = at::empty({t, heads, d}, x.options());
  const float* xp = in.data_ptr<float>();
  const float* cp = c.data_ptr<float>();
  const float* sp = s.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t st = in.stride(0), sh = in.stride(1);
  vector = vector && airserve_cpu::has_avx2_fma();
  airserve_cpu::for_each_row(t, heads * d, [&](int64_t r) {
    for (int64_t h = 0; h < heads; ++h) {
      const float* src = xp + r * st + h * sh;
      float* dst = op + (r * heads + h) * d;
#ifdef AIRSERVE_NORM_AVX2
      if (vector) {
        norm_avx2::rotate(src, cp + r * d, sp + r * d, dst, d);
        continue;
      }
#endif
      rotate_portable(src, cp + r * d, sp + r * d, dst, d);
    }
  });
  return out;
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  return rms_norm_impl(x, w, eps, true, false, "airserve::rms_norm");
}
at::Tensor rms_norm_portable(const at::Tensor& x, const at::Tensor& w, double eps) {
  return rms_norm_impl(x, w, eps, false, false, "airserve::rms_norm");
}
at::Tensor rms_norm_bf16(const at::Tensor& x, const at::Tensor& w, double eps) {
  return rms_norm_impl(x, w, eps, true, true, "airserve::rms_norm_bf16");
}
at::Tensor rotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  return rotary_impl(x, cos, sin, true);
}
at::Tensor rotary_portable(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  return rotary_impl(x, cos, sin, false);
}

}  // namespace

TORCH_LIBRARY_IMPL(airserve, CPU, lib) {
  lib.impl("rms_norm", &rms_norm);
  lib.impl("rms_norm_portable", &rms_norm_portable);
  lib.impl("rms_norm_bf16", &rms_norm_bf16);
  lib.impl("rotary", &rotary);
  lib.impl("rotary_portable", &rotary_portable);
}
