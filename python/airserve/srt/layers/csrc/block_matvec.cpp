// Matrix products of float32 activations with GGML block-quantized weights, for decode.
//
// Weights stay in the GGUF block layout (ggml-common.h): every row of a [N, K] weight is K/32
// blocks of 32 values with fp16 scales. Each product is computed in float32 from the exact
// block values, so the result equals x @ dequantize(w).T up to summation order.
//   Q4_1: value[j] = d * q[j] + m, q[j] 4-bit; byte j of a block holds q[j] (low nibble) and
//         q[j + 16] (high nibble).          qs: uint8 [N, K/2], d, m: float16 [N, K/32]
//   Q8_0: value[j] = d * q[j], q[j] int8.  qs: int8 [N, K],    d: float16 [N, K/32]
//   other kinds (block_int8.cpp's block_matmul_f32): through block_unpack.h's groups.
// Every weight block is unpacked once and used for up to 8 (AVX2) or 16 (AVX-512) rows of x,
// so a small batch costs about as much as one row: the weights are read once per step, at a
// quarter (Q4_1) or a third (Q8_0) of the bytes of float32.
//
// The loops (block_f32_rows.inc) are compiled for AVX-512, AVX2+FMA+F16C and plain C++ through
// target options whatever the build machine is; one is picked at run time from the CPU's
// features (set_f32_isa narrows the choice for tests and benchmarks).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <atomic>
#include <cstdint>
#include <string>
#include <vector>

#include "block_f32.h"
#include "isa_select.h"

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define AIRSERVE_F32_X86 1
#endif

namespace f32_scalar {
#define AIRSERVE_F32_SCALAR 1
#include "block_f32_rows.inc"
#undef AIRSERVE_F32_SCALAR
}  // namespace f32_scalar

#if defined(AIRSERVE_F32_X86) && defined(__GNUC__) && !defined(__clang__)
#define AIRSERVE_F32_HAS_SIMD 1
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
namespace f32_avx2 {
#define AIRSERVE_F32_AVX2 1
#include "block_f32_rows.inc"
#undef AIRSERVE_F32_AVX2
}  // namespace f32_avx2
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512vl")
namespace f32_avx512 {
#define AIRSERVE_F32_AVX512 1
#include "block_f32_rows.inc"
#undef AIRSERVE_F32_AVX512
}  // namespace f32_avx512
#pragma GCC pop_options
#endif

namespace {

constexpr int64_t kBlock = 32;
constexpr int64_t kMaxRows = 16;
// Output columns are split across torch's intra-op threads in chunks of at least this many.
constexpr int64_t kGrain = 32;

// Instruction sets, best first; g_isa holds an index into this table.
const char* const kIsaNames[] = {"avx512", "avx2", "scalar"};
using RunFn = void (*)(const airserve_f32::Job&, int64_t, int64_t, int64_t);

bool isa_supported(int isa) {
#if defined(AIRSERVE_F32_HAS_SIMD)
  __builtin_cpu_init();
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                    __builtin_cpu_supports("f16c");
  if (isa == 0)
    return avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl");
  if (isa == 1) return avx2;
#endif
  return isa == 2;
}

RunFn isa_fn(int isa) {
#if defined(AIRSERVE_F32_HAS_SIMD)
  if (isa == 0) return f32_avx512::run;
  if (isa == 1) return f32_avx2::run;
#endif
  return f32_scalar::run;
}

constexpr int kIsaCount = 3;  // entries of kIsaNames
std::atomic<int> g_isa{-1};

int best_isa() { return airserve_isa::best(kIsaCount, isa_supported); }
int current_isa() { return airserve_isa::current(g_isa, kIsaCount, isa_supported); }

void check_inputs(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& d,
                  int64_t packed_per_row, const char* name) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              name, ": x must be a contiguous float32 [M, K] tensor");
  TORCH_CHECK(x.size(0) >= 1 && x.size(0) <= kMaxRows, name, ": at least 1 and at most ",
              kMaxRows, " rows, got ", x.size(0));
  const int64_t K = x.size(1);
  TORCH_CHECK(K % kBlock == 0, name, ": K=", K, " is not a multiple of ", kBlock);
  TORCH_CHECK(qs.dim() == 2 && qs.size(1) == K / kBlock * packed_per_row && qs.is_contiguous(),
              name, ": qs must be contiguous [N, ", K / kBlock * packed_per_row, "]");
  TORCH_CHECK(d.scalar_type() == at::kHalf && d.is_contiguous() && d.dim() == 2 &&
                  d.size(0) == qs.size(0) && d.size(1) == K / kBlock,
              name, ": d must be contiguous float16 [N, K/32]");
}

void run_parallel(const airserve_f32::Job& job, int64_t M) {
  const RunFn run = isa_fn(current_isa());
  at::parallel_for(0, job.N, kGrain, [&](int64_t n0, int64_t n1) { run(job, M, n0, n1); });
}

at::Tensor q4_1_matmul(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& d,
                       const at::Tensor& m) {
  check_inputs(x, qs, d, 16, "airserve::q4_1_matmul");
  TORCH_CHECK(qs.scalar_type() == at::kByte, "airserve::q4_1_matmul: qs must be uint8");
  TORCH_CHECK(m.sizes() == d.sizes() && m.scalar_type() == at::kHalf && m.is_contiguous(),
              "airserve::q4_1_matmul: m must be contiguous float16 like d");
  const int64_t M = x.size(0), K = x.size(1), N = qs.size(0), nb = K / kBlock;
  at::Tensor out = at::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  // Block sums of x for the kernels that add the `m` term separately: [M, K/32].
  std::vector<float> xsum(M * nb);
  for (int64_t i = 0; i < M * nb; ++i) {
    float s = 0.f;
    for (int64_t j = 0; j < kBlock; ++j) s += xp[i * kBlock + j];
    xsum[i] = s;
  }
  const airserve_f32::Job job{airserve_blocks::kQ4_1, qs.data_ptr<uint8_t>(), K / 2,
                              d.data_ptr<at::Half>(), m.data_ptr<at::Half>(), K, N, nb, xp,
                              xsum.data(), out.data_ptr<float>()};
  run_parallel(job, M);
  return out;
}

at::Tensor q8_0_matmul(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& d) {
  check_inputs(x, qs, d, kBlock, "airserve::q8_0_matmul");
  TORCH_CHECK(qs.scalar_type() == at::kChar, "airserve::q8_0_matmul: qs must be int8");
  const int64_t M = x.size(0), K = x.size(1), N = qs.size(0);
  at::Tensor out = at::empty({M, N}, x.options());
  const airserve_f32::Job job{airserve_blocks::kQ8_0,
                              reinterpret_cast<const uint8_t*>(qs.data_ptr<int8_t>()), K,
                              d.data_ptr<at::Half>(), nullptr, K, N, K / kBlock,
                              x.data_ptr<float>(), nullptr, out.data_ptr<float>()};
  run_parallel(job, M);
  return out;
}

std::vector<std::string> f32_isas() {
  std::vector<std::string> names;
  for (int i = 0; i < 3; ++i)
    if (isa_supported(i)) names.emplace_back(kIsaNames[i]);
  return names;
}

std::string f32_isa() { return kIsaNames[current_isa()]; }

// Narrows the instruction set the float32 products use ("auto": the best this CPU has). For
// tests and benchmarks; returns the one now in use.
std::string set_f32_isa(const std::string& name) {
  if (name == "auto") {
    g_isa.store(best_isa());
    return f32_isa();
  }
  for (int i = 0; i < 3; ++i) {
    if (name != kIsaNames[i]) continue;
    TORCH_CHECK(isa_supported(i), "airserve::set_f32_isa: this CPU (or compiler) lacks ", name);
    g_isa.store(i);
    return f32_isa();
  }
  TORCH_CHECK(false, "airserve::set_f32_isa: unknown instruction set '", name,
              "' (auto, avx512, avx2, scalar)");
}

}  // namespace

namespace airserve_f32 {

void rows(const Job& job, int64_t M, int64_t n0, int64_t n1) {
  isa_fn(current_isa())(job, M, n0, n1);
}

const char* isa() { return kIsaNames[current_isa()]; }

}  // namespace airserve_f32

TORCH_LIBRARY_IMPL(airserve, CPU, lib) {
  lib.impl("q4_1_matmul", &q4_1_matmul);
  lib.impl("q8_0_matmul", &q8_0_matmul);
}

TORCH_LIBRARY_FRAGMENT(airserve_isa, lib) {
  lib.def("f32_isa() -> str", &f32_isa);
  lib.def("f32_isas() -> str[]", &f32_isas);
  lib.def("set_f32_isa(str name) -> str", &set_f32_isa);
}
