// SiLU-gated product of a merged gate/up projection in one pass: out = silu(gate) * up, where
// gate_up = [gate | up] along the last dimension (SGLang's SiluAndMul), float32 out.
//
// The bfloat16 matmul path hands its [M, 2N] output over as bfloat16; widening it to float32
// first, then silu, then the product, made three passes over the largest activation of a
// prefill step and a fresh 2N-wide float32 buffer each layer (page faults on every call: ~1.7
// ms a layer for 512 x 3072 on a 2-core AMD EPYC, more than silu and the product together).
// Here each element is read once, the arithmetic is float32 and the one result is written.
// silu(g) is g / (1 + e^-g), as torch computes it.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <tuple>
#include <vector>

#include "cpu_common.h"

#if (defined(__x86_64__) || defined(_M_X64)) && defined(__GNUC__) && !defined(__clang__)
#include <immintrin.h>
#define AIRSERVE_ACT_AVX2 1
#endif

namespace {

using airserve_cpu::widen;

template <typename T>
void silu_mul_portable(const T* gate, const T* up, float* out, int64_t n) {
  for (int64_t j = 0; j < n; ++j) {
    const float g = widen(gate[j]);
    out[j] = g / (1.f + std::exp(-g)) * widen(up[j]);
  }
}

#ifdef AIRSERVE_ACT_AVX2
#pragma GCC push_options
#pragma GCC target("avx2,fma")
namespace act_avx2 {
#include "avx2_common.inc"

template <typename T>
void silu_mul(const T* gate, const T* up, float* out, int64_t n) {
  const __m256 one = _mm256_set1_ps(1.f);
  const __m256 sign = _mm256_set1_ps(-0.f);
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    const __m256 g = load8(gate + j);
    __m256 s = _mm256_div_ps(g, _mm256_add_ps(one, exp8(_mm256_xor_ps(g, sign))));
    // Below -88, e^-g (clamped at e^88) no longer makes silu ~0 for huge |g|: g * 0 there
    // (-0, or NaN for -inf, as torch's g / (1 + inf)).
    s = _mm256_blendv_ps(s, _mm256_mul_ps(g, _mm256_setzero_ps()),
                         _mm256_cmp_ps(g, _mm256_set1_ps(-88.f), _CMP_LT_OQ));
    _mm256_storeu_ps(out + j, _mm256_mul_ps(s, load8(up + j)));
  }
  silu_mul_portable(gate + j, up + j, out + j, n - j);
}
}  // namespace act_avx2
#pragma GCC pop_options
#endif  // AIRSERVE_ACT_AVX2

// One row: out[j] = silu(gate[j]) * up[j], j < n (gate_up = [gate | up]); `vector` takes the
// AVX2 loop where it is compiled.
template <typename T>
void silu_mul_row(const T* gate_up, float* out, int64_t n, bool vector) {
#ifdef AIRSERVE_ACT_AVX2
  if (vector) return act_avx2::silu_mul(gate_up, gate_up + n, out, n);
#else
  (void)vector;
#endif
  silu_mul_portable(gate_up, gate_up + n, out, n);
}

template <typename T>
void run(const at::Tensor& gate_up, at::Tensor& out, bool vector) {
  const int64_t m = gate_up.size(0), n = out.size(1);
  const T* in = gate_up.data_ptr<T>();
  float* o = out.data_ptr<float>();
  airserve_cpu::for_each_row(m, n, [&](int64_t r) {
    silu_mul_row(in + r * 2 * n, o + r * n, n, vector);
  });
}

// gate_up [M, 2N] float32 or bfloat16 -> float32 [M, N]. `vector` false runs the plain C++
// loop on any CPU (tests compare the two).
at::Tensor silu_and_mul_impl(const at::Tensor& gate_up, bool vector) {
  TORCH_CHECK(gate_up.dim() == 2, "airserve::silu_and_mul: gate_up must be [rows, 2 * n], got ",
              gate_up.dim(), " dimensions");
  TORCH_CHECK(gate_up.size(1) % 2 == 0, "airserve::silu_and_mul: gate_up's last dimension (",
              gate_up.size(1), ") must be even: [gate | up]");
  const auto dtype = gate_up.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16,
              "airserve::silu_and_mul: gate_up must be float32 or bfloat16, got ", dtype);
  const at::Tensor in = gate_up.contiguous();
  at::Tensor out = at::empty({in.size(0), in.size(1) / 2}, in.options().dtype(at::kFloat));
  vector = vector && airserve_cpu::has_avx2_fma();
  if (dtype == at::kFloat) run<float>(in, out, vector);
  else run<c10::BFloat16>(in, out, vector);
  return out;
}

at::Tensor silu_and_mul(const at::Tensor& gate_up) { return silu_and_mul_impl(gate_up, true); }

// The same product for a down projection that multiplies in bf16 (quant/matmul_paths.py), in
// the form that product reads: gate_up bf16 [M, 2N] -> (act, err) with act bf16 [M, N], the
// float32 product rounded as torch rounds (cast_to_bf16 of silu_and_mul's output, bit for
// bit), and err float32 [M, k], that product less its rounding at the weight's residual input
// `channels` (int64 [k]; k = 0 without), as bf16_rounding_error gives it. Each row is computed
// into a float32 row that stays in L1 and leaves as bf16: the float32 [M, N] activations are
// never written and read back (in a 512-token prefill step of the default model, 3 MiB a
// layer each way, from memory rather than cache inside the step).
std::tuple<at::Tensor, at::Tensor> silu_and_mul_bf16(const at::Tensor& gate_up,
                                                     const c10::optional<at::Tensor>& channels) {
  const char* name = "airserve::silu_and_mul_bf16";
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.size(1) % 2 == 0 &&
                  gate_up.scalar_type() == at::kBFloat16,
              name, ": gate_up must be bfloat16 [rows, 2 * n], got ", gate_up.scalar_type(), " ",
              gate_up.sizes());
  const at::Tensor in = gate_up.contiguous();
  const int64_t m = in.size(0), n = in.size(1) / 2;
  const at::Tensor ch =
      airserve_cpu::checked_channels(channels.has_value() ? *channels : at::empty({0}), n, name);
  const int64_t k = ch.numel();
  const int64_t* c = ch.data_ptr<int64_t>();
  at::Tensor act = at::empty({m, n}, in.options());
  at::Tensor err = at::empty({m, k}, in.options().dtype(at::kFloat));
  const auto* src = in.data_ptr<c10::BFloat16>();
  auto* dst = reinterpret_cast<uint16_t*>(act.data_ptr<c10::BFloat16>());
  float* e = err.data_ptr<float>();
  const bool vector = airserve_cpu::has_avx2_fma();
  at::parallel_for(0, m, airserve_cpu::grain_rows(2 * n), [&](int64_t r0, int64_t r1) {
    std::vector<float> row(n);
    for (int64_t r = r0; r < r1; ++r) {
      silu_mul_row(src + r * 2 * n, row.data(), n, vector);
      airserve_cpu::f32_to_bf16(row.data(), dst + r * n, n);
      for (int64_t j = 0; j < k; ++j) e[r * k + j] = airserve_cpu::bf16_residual(row[c[j]]);
    }
  });
  return {act, err};
}

at::Tensor silu_and_mul_portable(const at::Tensor& gate_up) {
  return silu_and_mul_impl(gate_up, false);
}

}  // namespace

TORCH_LIBRARY_IMPL(airserve, CPU, lib) {
  lib.impl("silu_and_mul", &silu_and_mul);
  lib.impl("silu_and_mul_portable", &silu_and_mul_portable);
  lib.impl("silu_and_mul_bf16", &silu_and_mul_bf16);
}
