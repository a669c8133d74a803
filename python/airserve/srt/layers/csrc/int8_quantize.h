// block_int8.cpp's activation quantizer for other products (block_int8_gemm.cpp): x [M, K] to
// int8 per block of 32 (xq), block scales xd = max|x| / 127 and scaled sums xs = xd * sum q, on
// the int8 products' current instruction set (every one gives the same bits). Returns whether
// that set is "scalar" (the portable loops, or a test's set_int8_isa("scalar")).
#pragma once

#include <cstdint>

namespace airserve_int8 {
bool quantize(const float* x, int64_t M, int64_t K, int8_t* xq, float* xd, float* xs);
}  // namespace airserve_int8
