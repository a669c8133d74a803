// Two operators on the logits [rows, vocab].
//
// argmax_rows: greedy sampling's argmax over each row (float32 or bfloat16):
// the index of the first largest value, or of the first NaN when a row has one, as torch.max's
// indices give it. torch's max(dim) took ~1.8 ms on [64, 49152] float32 (2 threads, AMD EPYC),
// about as long as it is across bfloat16 too: ~3% of a batch-64 decode step. Here each row is
// read twice from cache (its largest value, then where it first occurs) with eight-lane
// compares, rows split over the threads.
//
// refine_top_logits_: a bfloat16 lm_head product comes out rounded to bf16 (8 significant bits:
// steps of 0.125 at logits of 16-32), so near-equal top tokens tie, and a tie goes to the lower
// token id. In place, each row's candidates for the top (every logit within 2^-7 of the row's
// largest, relative: twice bf16's largest relative rounding error, so no other token can be
// the float32 argmax) are recomputed in float32 from the hidden state and the float32 weight,
// at most max_k of them per row (the largest, when more tie). A few dot products a row.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <utility>
#include <vector>

#include "cpu_common.h"

#if (defined(__x86_64__) || defined(_M_X64)) && defined(__GNUC__) && !defined(__clang__)
#include <immintrin.h>
#define AIRSERVE_ARGMAX_AVX2 1
#endif

namespace {

using airserve_cpu::widen;

template <typename T>
int64_t argmax_portable(const T* row, int64_t n) {
  int64_t best = 0;
  float mx = widen(row[0]);
  if (std::isnan(mx)) return 0;
  for (int64_t j = 1; j < n; ++j) {
    const float x = widen(row[j]);
    if (std::isnan(x)) return j;
    if (x > mx) {
      mx = x;
      best = j;
    }
  }
  return best;
}

#ifdef AIRSERVE_ARGMAX_AVX2
#pragma GCC push_options
#pragma GCC target("avx2,fma")
namespace argmax_avx2 {

#include "avx2_common.inc"

template <typename T>
int64_t argmax(const T* row, int64_t n) {
  if (n < 16) return argmax_portable(row, n);
  // Pass 1: the largest value, and whether any lane saw a NaN.
  __m256 mx = load8(row), nan = _mm256_cmp_ps(mx, mx, _CMP_UNORD_Q);
  int64_t j = 8;
  for (; j + 8 <= n; j += 8) {
    const __m256 x = load8(row + j);
    mx = _mm256_max_ps(mx, x);
    nan = _mm256_or_ps(nan, _mm256_cmp_ps(x, x, _CMP_UNORD_Q));
  }
  float m = -INFINITY;
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, mx);
  for (float v : lanes) m = v > m ? v : m;
  bool has_nan = _mm256_movemask_ps(nan) != 0;
  for (int64_t t = j; t < n; ++t) {
    const float x = widen(row[t]);
    if (std::isnan(x)) has_nan = true;
    else if (x > m) m = x;
  }
  if (has_nan) return argmax_portable(row, n);  // the first NaN
  // Pass 2: where the largest value first occurs.
  const __m256 target = _mm256_set1_ps(m);
  for (j = 0; j + 8 <= n; j += 8) {
    const int mask = _mm256_movemask_ps(_mm256_cmp_ps(load8(row + j), target, _CMP_EQ_OQ));
    if (mask) return j + __builtin_ctz(mask);
  }
  for (; j < n; ++j)
    if (widen(row[j]) == m) return j;
  return 0;  // unreachable: m is one of the row's values
}

// Appends (value, index) of every row[j] >= floor to `out`, in index order.
void collect(const float* row, int64_t n, float floor,
             std::vector<std::pair<float, int64_t>>& out) {
  const __m256 f = _mm256_set1_ps(floor);
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    int mask = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(row + j), f, _CMP_GE_OQ));
    while (mask) {
      const int b = __builtin_ctz(mask);
      out.emplace_back(row[j + b], j + b);
      mask &= mask - 1;
    }
  }
  for (; j < n; ++j)
    if (row[j] >= floor) out.emplace_back(row[j], j);
}

}  // namespace argmax_avx2
#pragma GCC pop_options
#endif  // AIRSERVE_ARGMAX_AVX2

// One row's argmax, by the vector loops when `vector` (and compiled), else the plain one.
template <typename T>
int64_t row_argmax(const T* row, int64_t n, bool vector) {
#ifdef AIRSERVE_ARGMAX_AVX2
  if (vector) return argmax_avx2::argmax(row, n);
#endif
  return argmax_portable(row, n);
}

template <typename T>
void run(const at::Tensor& logits, at::Tensor& out, bool vector) {
  const int64_t rows = logits.size(0), n = logits.size(1);
  const T* p = logits.data_ptr<T>();
  int64_t* o = out.data_ptr<int64_t>();
  airserve_cpu::for_each_row(rows, n,
                             [&](int64_t r) { o[r] = row_argmax(p + r * n, n, vector); });
}

at::Tensor argmax_rows_impl(const at::Tensor& logits, bool vector) {
  TORCH_CHECK(logits.dim() == 2 && logits.size(1) > 0,
              "airserve::argmax_rows: logits must be [rows, vocab] with vocab > 0");
  const auto dtype = logits.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16,
              "airserve::argmax_rows: logits must be float32 or bfloat16, got ", dtype);
  const at::Tensor in = logits.contiguous();
  at::Tensor out = at::empty({in.size(0)}, in.options().dtype(at::kLong));
  vector = vector && airserve_cpu::has_avx2_fma();
  if (dtype == at::kFloat) run<float>(in, out, vector);
  else run<c10::BFloat16>(in, out, vector);
  return out;
}

at::Tensor argmax_rows(const at::Tensor& logits) { return argmax_rows_impl(logits, true); }

// Relative distance below a row's largest logit within which a token is a candidate.
constexpr float kRefineMargin = 1.f / 128.f;

void refine_top_logits_(at::Tensor& logits, const at::Tensor& hidden, const at::Tensor& weight,
                        const c10::optional<at::Tensor>& bias, int64_t max_k) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.is_contiguous(),
              "airserve::refine_top_logits_: logits must be contiguous float32 [rows, vocab]");
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  TORCH_CHECK(hidden.dim() == 2 && hidden.size(0) == rows && hidden.scalar_type() == at::kFloat,
              "airserve::refine_top_logits_: hidden must be float32 [", rows, ", dim]");
  const int64_t dim = hidden.size(1);
  TORCH_CHECK(weight.dim() == 2 && weight.size(0) == vocab && weight.size(1) == dim &&
                  weight.scalar_type() == at::kFloat,
              "airserve::refine_top_logits_: weight must be float32 [", vocab, ", ", dim, "]");
  TORCH_CHECK(!bias || (bias->dim() == 1 && bias->size(0) == vocab &&
                        bias->scalar_type() == at::kFloat),
              "airserve::refine_top_logits_: bias must be float32 [", vocab, "]");
  TORCH_CHECK(max_k > 0, "airserve::refine_top_logits_: max_k must be positive");
  if (rows == 0 || vocab == 0) return;
  const at::Tensor h = hidden.contiguous(), w = weight.contiguous();
  const at::Tensor b = bias ? bias->contiguous() : at::Tensor();
  float* lp = logits.data_ptr<float>();
  const float* hp = h.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  const float* bp = bias ? b.data_ptr<float>() : nullptr;
  const bool vector = airserve_cpu::has_avx2_fma();
  at::parallel_for(0, rows, 1, [&](int64_t r0, int64_t r1) {
    std::vector<std::pair<float, int64_t>> cand;
    for (int64_t r = r0; r < r1; ++r) {
      float* row = lp + r * vocab;
      const float m = row[row_argmax(row, vocab, vector)];
      if (!std::isfinite(m)) continue;  // NaN or inf: nothing to refine against
      const float floor = m - std::fabs(m) * kRefineMargin;
      cand.clear();
#ifdef AIRSERVE_ARGMAX_AVX2
      if (vector) argmax_avx2::collect(row, vocab, floor, cand);
      else
#endif
        for (int64_t j = 0; j < vocab; ++j)
          if (row[j] >= floor) cand.emplace_back(row[j], j);
      if (static_cast<int64_t>(cand.size()) > max_k) {
        std::partial_sort(cand.begin(), cand.begin() + max_k, cand.end(),
                          [](const auto& a, const auto& c) {
                            return a.first > c.first || (a.first == c.first && a.second < c.second);
                          });
        cand.resize(max_k);
      }
      const float* x = hp + r * dim;
      for (const auto& c : cand) {
        const float* wr = wp + c.second * dim;
        float acc = 0.f;
        for (int64_t d = 0; d < dim; ++d) acc += x[d] * wr[d];
        row[c.second] = bp ? acc + bp[c.second] : acc;
      }
    }
  });
}

at::Tensor argmax_rows_portable(const at::Tensor& logits) {
  return argmax_rows_impl(logits, false);
}

}  // namespace

TORCH_LIBRARY_IMPL(airserve, CPU, lib) {
  lib.impl("argmax_rows", &argmax_rows);
  lib.impl("argmax_rows_portable", &argmax_rows_portable);
  lib.impl("refine_top_logits_", &refine_top_logits_);
}
