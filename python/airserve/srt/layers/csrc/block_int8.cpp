// Products of activations with GGML block weights of every kind airserve keeps packed, for
// decode (at most 16 rows), and their dequantization for larger batches.
//
//   block_matmul_int8: each row of x is quantized to int8 per block of 32 (scale xd = max|x|/127,
//     and xs = xd * sum(q) for the kinds with a minimum), then multiplied with the weight's
//     integer values by integer dot products: AVX-512 VNNI, AVX-VNNI, AVX2 (maddubs + madd) or
//     portable C++, chosen at run time from the CPU's features (all four are compiled on every
//     x86 machine through target options; set_int8_isa narrows the choice for tests).
//   block_matmul_f32: float32 activations times the exact block values (the kinds other than
//     q4_1, which q4_1_matmul serves), on block_matvec.cpp's loops.
//   dequantize_blocks: float32 [N, K] values, for batches above the packed limit.
// Weight forms: q4_1 / q8_0 as split tensors (qs, d, m; see block_matvec.cpp); q5_0, q5_1,
// q4_k, q5_k, q6_k as the GGUF blocks' raw bytes, uint8 [N, K / values_per_block * bytes].
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <atomic>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define AIRSERVE_X86 1
#endif

#include "block_f32.h"
#include "int8_quantize.h"
#include "isa_select.h"
#include "block_unpack.h"

namespace {

using airserve_blocks::Kind;

constexpr int64_t kMaxRows = 16;
constexpr int64_t kGrain = 32;  // output rows per parallel task, at least

// The weight and the quantized activations of one product.
struct Int8Job {
  Kind kind;
  const uint8_t* qs;
  int64_t qs_stride;  // bytes per weight row
  const at::Half* d;
  const at::Half* m;
  int64_t K, N, nb;  // nb = K / 32
  const int8_t* xq;  // [M, K]
  const float* xd;   // [M, nb]
  const float* xs;   // [M, nb]
  float* out;        // [M, N]
  airserve_blocks::Row row(int64_t n) const {
    return {kind, qs + n * qs_stride, d ? d + n * nb : nullptr, m ? m + n * nb : nullptr};
  }
};

}  // namespace

// One copy of the product loop per instruction set (block_int8_rows.inc).
// The portable copy is not auto-vectorized: built with -march=native on a CPU with AVX-512 VNNI,
// GCC 12 turned its signed int8 dot products (Q8_0, Q6_K) into vpdpbusd, whose first operand
// is unsigned, and every product with a negative weight came out wrong (found on an AMD EPYC
// with avx512_vnni: those products were off by ~9x of their size, unsigned kinds were exact).
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC push_options
#pragma GCC optimize("no-tree-vectorize")
#endif
namespace isa_scalar {
using ::Int8Job;
#define AIRSERVE_ISA_SCALAR 1
#include "block_int8_rows.inc"
#undef AIRSERVE_ISA_SCALAR
}  // namespace isa_scalar
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC pop_options
#endif

#if defined(AIRSERVE_X86) && defined(__GNUC__) && !defined(__clang__)
#define AIRSERVE_HAS_SIMD 1
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
namespace isa_avx2 {
using ::Int8Job;
#define AIRSERVE_ISA_AVX2 1
#include "block_int8_rows.inc"
#undef AIRSERVE_ISA_AVX2
}  // namespace isa_avx2
#pragma GCC pop_options

#if __GNUC__ >= 11  // the first GCC that knows AVX-VNNI
#define AIRSERVE_HAS_AVX_VNNI 1
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avxvnni")
namespace isa_avx_vnni {
using ::Int8Job;
#define AIRSERVE_ISA_AVX_VNNI 1
#include "block_int8_rows.inc"
#undef AIRSERVE_ISA_AVX_VNNI
}  // namespace isa_avx_vnni
#pragma GCC pop_options
#endif

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")
namespace isa_avx512_vnni {
using ::Int8Job;
#define AIRSERVE_ISA_AVX512_VNNI 1
#include "block_int8_rows.inc"
#undef AIRSERVE_ISA_AVX512_VNNI
}  // namespace isa_avx512_vnni
#pragma GCC pop_options
#endif

namespace {

// Instruction sets, best first. Index into this table is what g_isa holds. AVX-VNNI comes before
// AVX-512 VNNI: both run the same 256-bit loops, and on a 2-core Intel Xeon with both (family 6
// model 167) the AVX-512 build of them was ~30% slower (bench_kernels.py --all-isas, 2 threads,
// bs 1, median us: Q4_1 [1536, 576] 27.3 against 20.1, Q5_0 36.1 against 27.9; AVX2 20.5 and
// 28.4). CPUs with AVX-512 VNNI and no AVX-VNNI (AMD Zen4, Intel Ice Lake) still take it.
const char* const kIsaNames[] = {"avx_vnni", "avx512_vnni", "avx2", "scalar"};
using RunFn = void (*)(const Int8Job&, int64_t, int64_t, int64_t);
using QuantizeFn = void (*)(const float*, int64_t, int64_t, int8_t*, float*, float*);

bool isa_supported(int isa) {
#if defined(AIRSERVE_HAS_SIMD)
  __builtin_cpu_init();
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  switch (isa) {
#if defined(AIRSERVE_HAS_AVX_VNNI)
    case 0: return avx2 && __builtin_cpu_supports("avxvnni");
#endif
    case 1:
      return avx2 && __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512vl") &&
             __builtin_cpu_supports("avx512bw");
    case 2: return avx2;
    default: break;
  }
#endif
  return isa == 3;
}

RunFn isa_fn(int isa) {
  switch (isa) {
#if defined(AIRSERVE_HAS_SIMD)
#if defined(AIRSERVE_HAS_AVX_VNNI)
    case 0: return isa_avx_vnni::run;
#endif
    case 1: return isa_avx512_vnni::run;
    case 2: return isa_avx2::run;
#endif
    default: return isa_scalar::run;
  }
}

QuantizeFn isa_quantize(int isa) {
  switch (isa) {
#if defined(AIRSERVE_HAS_SIMD)
#if defined(AIRSERVE_HAS_AVX_VNNI)
    case 0: return isa_avx_vnni::quantize;
#endif
    case 1: return isa_avx512_vnni::quantize;
    case 2: return isa_avx2::quantize;
#endif
    default: return isa_scalar::quantize;
  }
}

constexpr int kIsaCount = 4;  // entries of kIsaNames
std::atomic<int> g_isa{-1};

int best_isa() { return airserve_isa::best(kIsaCount, isa_supported); }
int current_isa() { return airserve_isa::current(g_isa, kIsaCount, isa_supported); }

Kind parse_kind(const std::string& s, const char* op) {
  static const char* names[] = {"q4_1", "q8_0", "q5_0", "q5_1", "q4_k", "q5_k", "q6_k"};
  for (int i = 0; i < 7; ++i)
    if (s == names[i]) return static_cast<Kind>(i);
  TORCH_CHECK(false, op, ": unknown block kind '", s,
              "' (q4_1, q8_0, q5_0, q5_1, q4_k, q5_k, q6_k)");
}

// Checks the weight tensors of kind k for K inputs; returns its bytes per row.
int64_t check_weight(Kind k, int64_t K, const at::Tensor& qs, const c10::optional<at::Tensor>& d,
                     const c10::optional<at::Tensor>& m, const char* op) {
  TORCH_CHECK(qs.dim() == 2 && qs.is_contiguous(), op, ": qs must be a contiguous 2-D tensor");
  if (k == airserve_blocks::kQ4_1 || k == airserve_blocks::kQ8_0) {
    const int64_t per_row = k == airserve_blocks::kQ4_1 ? K / 2 : K;
    TORCH_CHECK(K % 32 == 0, op, ": K=", K, " is not a multiple of 32");
    TORCH_CHECK(qs.size(1) == per_row &&
                    qs.scalar_type() == (k == airserve_blocks::kQ4_1 ? at::kByte : at::kChar),
                op, ": qs must be [N, ", per_row, "] of ", k == airserve_blocks::kQ4_1 ? "uint8" :
                "int8");
    TORCH_CHECK(d.has_value() && d->scalar_type() == at::kHalf && d->is_contiguous() &&
                    d->dim() == 2 && d->size(0) == qs.size(0) && d->size(1) == K / 32,
                op, ": d must be contiguous float16 [N, K/32]");
    if (k == airserve_blocks::kQ4_1)
      TORCH_CHECK(m.has_value() && m->sizes() == d->sizes() && m->scalar_type() == at::kHalf &&
                      m->is_contiguous(), op, ": m must be contiguous float16 like d");
    return per_row;
  }
  const auto layout = airserve_blocks::raw_layout(k);
  TORCH_CHECK(K % layout.values == 0, op, ": K=", K, " is not a multiple of ", layout.values,
              " (the block size of this kind)");
  const int64_t per_row = K / layout.values * layout.bytes;
  TORCH_CHECK(qs.scalar_type() == at::kByte && qs.size(1) == per_row, op,
              ": qs must be the raw blocks, uint8 [N, ", per_row, "]");
  return per_row;
}

void check_x(const at::Tensor& x, const char* op) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), op,
              ": x must be a contiguous float32 [M, K] tensor");
  TORCH_CHECK(x.size(0) >= 1 && x.size(0) <= kMaxRows, op, ": 1 to ", kMaxRows,
              " rows, got ", x.size(0));
}

// The checks both products share, and their job without activations; `out` becomes [M, N].
static Int8Job checked_job(const at::Tensor& x, const std::string& kind, const at::Tensor& qs,
                           const c10::optional<at::Tensor>& d, const c10::optional<at::Tensor>& m,
                           const char* op, at::Tensor& out) {
  check_x(x, op);
  const Kind k = parse_kind(kind, op);
  const int64_t K = x.size(1), N = qs.size(0);
  TORCH_CHECK(K % 32 == 0, op, ": K=", K, " is not a multiple of 32");
  const int64_t stride = check_weight(k, K, qs, d, m, op);
  out = at::empty({x.size(0), N}, x.options());
  return Int8Job{k, static_cast<const uint8_t*>(qs.data_ptr()), stride,
                 d ? d->data_ptr<at::Half>() : nullptr, m ? m->data_ptr<at::Half>() : nullptr,
                 K, N, K / 32, nullptr, nullptr, nullptr, out.data_ptr<float>()};
}

at::Tensor block_matmul_int8(const at::Tensor& x, const std::string& kind, const at::Tensor& qs,
                             const c10::optional<at::Tensor>& d,
                             const c10::optional<at::Tensor>& m) {
  at::Tensor out;
  Int8Job job = checked_job(x, kind, qs, d, m, "airserve::block_matmul_int8", out);
  const int64_t M = x.size(0), K = job.K, N = job.N, nb = job.nb;
  std::vector<int8_t> xq(M * K);
  std::vector<float> xd(M * nb), xs(M * nb);
  const int isa = current_isa();
  isa_quantize(isa)(x.data_ptr<float>(), M, K, xq.data(), xd.data(), xs.data());
  job.xq = xq.data();
  job.xd = xd.data();
  job.xs = xs.data();
  const RunFn run = isa_fn(isa);
  at::parallel_for(0, N, kGrain, [&](int64_t n0, int64_t n1) { run(job, M, n0, n1); });
  return out;
}

// Float32 activations times the exact block values, on block_matvec.cpp's loops.
at::Tensor block_matmul_f32(const at::Tensor& x, const std::string& kind, const at::Tensor& qs,
                            const c10::optional<at::Tensor>& d,
                            const c10::optional<at::Tensor>& m) {
  at::Tensor out;
  const Int8Job job = checked_job(x, kind, qs, d, m, "airserve::block_matmul_f32", out);
  TORCH_CHECK(job.kind != airserve_blocks::kQ4_1,
              "airserve::block_matmul_f32: q4_1 blocks go through q4_1_matmul");
  const int64_t M = x.size(0);
  const float* xp = x.data_ptr<float>();
  std::vector<float> xsum;  // block sums of x [M, nb], for Q5_1's m and Q4_K's min terms
  if (job.kind == airserve_blocks::kQ5_1 || job.kind == airserve_blocks::kQ4_K) {
    xsum.resize(M * job.nb);
    for (int64_t i = 0; i < M * job.nb; ++i) {
      float s = 0.f;
      for (int64_t j = 0; j < 32; ++j) s += xp[i * 32 + j];
      xsum[i] = s;
    }
  }
  const airserve_f32::Job f32{job.kind, job.qs, job.qs_stride, job.d, job.m, job.K, job.N,
                              job.nb, xp, xsum.empty() ? nullptr : xsum.data(), job.out};
  at::parallel_for(0, job.N, kGrain,
                   [&](int64_t n0, int64_t n1) { airserve_f32::rows(f32, M, n0, n1); });
  return out;
}

at::Tensor dequantize_blocks(const std::string& kind, const at::Tensor& qs,
                             const c10::optional<at::Tensor>& d,
                             const c10::optional<at::Tensor>& m, int64_t K) {
  const char* op = "airserve::dequantize_blocks";
  const Kind k = parse_kind(kind, op);
  TORCH_CHECK(K > 0 && K % 32 == 0, op, ": K=", K, " is not a multiple of 32");
  const int64_t stride = check_weight(k, K, qs, d, m, op);
  const int64_t N = qs.size(0), nb = K / 32, ngroups = (nb + 7) / 8;
  at::Tensor out = at::empty({N, K}, qs.options().dtype(at::kFloat));
  float* op_ = out.data_ptr<float>();
  const Int8Job job{k, static_cast<const uint8_t*>(qs.data_ptr()), stride,
                    d ? d->data_ptr<at::Half>() : nullptr, m ? m->data_ptr<at::Half>() : nullptr,
                    K, N, nb, nullptr, nullptr, nullptr, nullptr};
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    airserve_blocks::Group g;
    for (int64_t n = n0; n < n1; ++n) {
      const airserve_blocks::Row row = job.row(n);
      for (int64_t gi = 0; gi < ngroups; ++gi) {
        airserve_blocks::unpack(row, gi, nb, g);
        const uint8_t* uq = reinterpret_cast<const uint8_t*>(g.q);
        float* w = op_ + n * K + gi * 256;
        for (int e = 0; e < 32 * g.nblocks; ++e) {
          const float q = g.is_signed ? float(g.q[e]) : float(uq[e]);
          w[e] = g.a[e / 32] * float(g.s16[e / 16]) * q + g.c[e / 32];
        }
      }
    }
  });
  return out;
}

std::string int8_isa() { return kIsaNames[current_isa()]; }

std::vector<std::string> int8_isas() {
  std::vector<std::string> names;
  for (int i = 0; i < 4; ++i)
    if (isa_supported(i)) names.emplace_back(kIsaNames[i]);
  return names;
}

// Narrows the instruction set the int8 products use ("auto": the best this CPU has). For tests
// and benchmarks; returns the one now in use.
std::string set_int8_isa(const std::string& name) {
  if (name == "auto") {
    g_isa.store(best_isa());
    return int8_isa();
  }
  for (int i = 0; i < 4; ++i) {
    if (name != kIsaNames[i]) continue;
    TORCH_CHECK(isa_supported(i), "airserve::set_int8_isa: this CPU (or compiler) lacks ", name);
    g_isa.store(i);
    return int8_isa();
  }
  TORCH_CHECK(false, "airserve::set_int8_isa: unknown instruction set '", name,
              "' (auto, avx_vnni, avx512_vnni, avx2, scalar)");
}

}  // namespace

bool airserve_int8::quantize(const float* x, int64_t M, int64_t K, int8_t* xq, float* xd,
                             float* xs) {
  const int isa = current_isa();
  isa_quantize(isa)(x, M, K, xq, xd, xs);
  return std::string(kIsaNames[isa]) == "scalar";
}

TORCH_LIBRARY_IMPL(airserve, CPU, lib) {
  lib.impl("block_matmul_int8", &block_matmul_int8);
  lib.impl("block_matmul_f32", &block_matmul_f32);
  lib.impl("dequantize_blocks", &dequantize_blocks);
}

TORCH_LIBRARY_FRAGMENT(airserve_isa, lib) {
  lib.def("int8_isa() -> str", &int8_isa);
  lib.def("int8_isas() -> str[]", &int8_isas);
  lib.def("set_int8_isa(str name) -> str", &set_int8_isa);
}
