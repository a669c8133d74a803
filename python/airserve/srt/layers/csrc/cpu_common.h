// Small helpers shared by the elementwise and logits operators (activation.cpp, logits.cpp,
// norm_rope.cpp) and the bf16 product (packed_or_large.cpp): plain C++, no target options.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace airserve_cpu {

inline float widen(float x) { return x; }
inline float widen(c10::BFloat16 x) { return static_cast<float>(x); }

// Whether the CPU runs the AVX2+FMA loops (compiled through target options whatever the build
// machine is).
inline bool has_avx2_fma() {
#if (defined(__x86_64__) || defined(_M_X64)) && defined(__GNUC__) && !defined(__clang__)
  static const bool ok = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return ok;
#else
  return false;
#endif
}

// Rows per at::parallel_for task for rows of `row_elements` elements: a task is at least
// ~16K elements (waking the pool for less costs more than the arithmetic).
inline int64_t grain_rows(int64_t row_elements) {
  return std::max<int64_t>(1, 16384 / std::max<int64_t>(row_elements, 1));
}

// fn(r) for r in [0, rows), rows of `row_elements` elements split over the threads.
template <typename Fn>
void for_each_row(int64_t rows, int64_t row_elements, const Fn& fn) {
  at::parallel_for(0, rows, grain_rows(row_elements), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) fn(r);
  });
}

// ---- float32 <-> bfloat16 for the bf16 matmul path's operands ----
//
// A decode step makes ~240 casts and widenings around its bf16 products (and the residual
// channels' x - bf16(x)); these plain loops, vectorized by the compiler for the build's CPU
// (-march=native), replace Tensor.to / index_select / sub through the dispatcher. Alone they
// cost about what torch's take (~18 us for a [64, 576] cast on a 2-core Sapphire Rapids VM:
// the work is memory traffic); what goes is ~4 dispatched operators per product. The rounding
// is torch's (c10::BFloat16: round to nearest even on the bits, NaN to 0x7fc0), not the
// AVX512-BF16 instruction's, which flushes float32 subnormals to zero.
inline uint16_t bf16_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  return (u & 0x7fffffffu) > 0x7f800000u ? uint16_t{0x7fc0} : static_cast<uint16_t>(rounded);
}

// The float a bf16's bits stand for (exact: the bits become the float's high half).
inline float bf16_value(uint16_t bits) {
  const uint32_t u = static_cast<uint32_t>(bits) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

inline void f32_to_bf16(const float* in, uint16_t* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = bf16_bits(in[i]);
}

inline void bf16_to_f32(const uint16_t* in, float* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = bf16_value(in[i]);
}

// Elements per task: below 2 x this one thread converts (waking the pool costs more).
constexpr int64_t kConvertGrain = 1 << 17;

// A float32 tensor as a new contiguous bfloat16 one of its shape (torch's values, bit for bit).
inline at::Tensor cast_to_bf16(const at::Tensor& x) {
  TORCH_CHECK(x.scalar_type() == at::kFloat, "airserve: cast_to_bf16 takes float32, got ",
              x.scalar_type());
  const at::Tensor in = x.contiguous();
  at::Tensor out = at::empty(in.sizes(), in.options().dtype(at::kBFloat16));
  const float* src = in.data_ptr<float>();
  auto* dst = reinterpret_cast<uint16_t*>(out.data_ptr<c10::BFloat16>());
  at::parallel_for(0, in.numel(), kConvertGrain, [&](int64_t a, int64_t b) {
    f32_to_bf16(src + a, dst + a, b - a);
  });
  return out;
}

// A bfloat16 tensor widened to a new contiguous float32 one (exact).
inline at::Tensor widen_to_f32(const at::Tensor& x) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16, "airserve: widen_to_f32 takes bfloat16, got ",
              x.scalar_type());
  const at::Tensor in = x.contiguous();
  at::Tensor out = at::empty(in.sizes(), in.options().dtype(at::kFloat));
  const auto* src = reinterpret_cast<const uint16_t*>(in.data_ptr<c10::BFloat16>());
  float* dst = out.data_ptr<float>();
  at::parallel_for(0, in.numel(), kConvertGrain, [&](int64_t a, int64_t b) {
    bf16_to_f32(src + a, dst + a, b - a);
  });
  return out;
}

// v less its bf16 rounding, v - bf16(v): what the bf16 path's residual channels add back.
inline float bf16_residual(float v) { return v - bf16_value(bf16_bits(v)); }

// A weight's residual input channels as a contiguous int64 tensor, each checked to lie within
// the `features` input features; `who` names the operator in the error.
inline at::Tensor checked_channels(const at::Tensor& channels, int64_t features,
                                   const char* who) {
  at::Tensor ch = channels.to(at::kLong).contiguous();
  const int64_t* c = ch.data_ptr<int64_t>();
  for (int64_t j = 0; j < ch.numel(); ++j)
    TORCH_CHECK(c[j] >= 0 && c[j] < features, who, ": residual channel ", c[j],
                " out of range for ", features, " input features");
  return ch;
}

// x float32 [M, K] -> [M, k]: x's columns `channels` (int64 [k]) less their bf16 rounding.
inline at::Tensor bf16_rounding_error(const at::Tensor& x, const at::Tensor& channels) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat,
              "airserve: bf16_rounding_error takes float32 [M, K]");
  const at::Tensor in = x.contiguous();
  const int64_t m = in.size(0), kin = in.size(1);
  const at::Tensor ch = checked_channels(channels, kin, "airserve");
  const int64_t k = ch.numel();
  const int64_t* c = ch.data_ptr<int64_t>();
  at::Tensor out = at::empty({m, k}, in.options());
  const float* src = in.data_ptr<float>();
  float* dst = out.data_ptr<float>();
  for (int64_t r = 0; r < m; ++r)
    for (int64_t j = 0; j < k; ++j) dst[r * k + j] = bf16_residual(src[r * kin + c[j]]);
  return out;
}

}  // namespace airserve_cpu
