// Small helpers shared by the elementwise and logits operators (activation.cpp, logits.cpp,
// norm_rope.cpp): plain C++, no target options.
#pragma once

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cstdint>

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

}  // namespace airserve_cpu
