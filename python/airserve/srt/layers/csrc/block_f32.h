// The float32-arithmetic block products (block_matvec.cpp), shared with block_int8.cpp's
// block_matmul_f32: out = x @ dequantize(w).T for at most 16 rows of x, where every weight
// value is the exact block value (for q4_1, d * q + m computed in float32).
#pragma once

#include <c10/util/Half.h>

#include <cstdint>

#include "block_unpack.h"

namespace airserve_f32 {

struct Job {
  airserve_blocks::Kind kind;
  const uint8_t* qs;
  int64_t qs_stride;  // bytes per weight row
  const at::Half* d;  // q4_1 / q8_0: [N, nb]; raw kinds: nullptr
  const at::Half* m;  // q4_1: [N, nb]; else nullptr
  int64_t K, N, nb;   // nb = K / 32
  const float* x;     // [M, K]
  const float* xsum;  // q4_1, q5_1, q4_k: block sums of x [M, nb]; else null
  float* out;         // [M, N]
  airserve_blocks::Row row(int64_t n) const {
    return {kind, qs + n * qs_stride, d ? d + n * nb : nullptr, m ? m + n * nb : nullptr};
  }
};

// Output columns [n0, n1) for M (1..16) rows of x, on the instruction set in use.
void rows(const Job& job, int64_t M, int64_t n0, int64_t n1);

// The instruction set in use: "avx512", "avx2" or "scalar" (plain C++).
const char* isa();

}  // namespace airserve_f32
