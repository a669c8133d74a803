// GGML weight blocks unpacked to small integers plus per-32 float coefficients, the one form
// every product in block_int8.cpp consumes (layouts: ggml-common.h, dequantize_row_* in
// ggml-quants.c). A group is up to 8 blocks of 32 values (one K-quant super-block of 256):
//   value[e] = a[e / 32] * s16[e / 16] * q[e] + c[e / 32]
// with q unsigned 0..63 (`is_signed` false) or signed int8, and s16 all ones except Q6_K.
#pragma once

#include <c10/util/Half.h>

#include <cstdint>
#include <cstring>

namespace airserve_blocks {

enum Kind : int { kQ4_1, kQ8_0, kQ5_0, kQ5_1, kQ4_K, kQ5_K, kQ6_K };

// Values per block and bytes per block of the raw kinds (kinds stored as GGUF bytes).
struct Layout {
  int64_t values;
  int64_t bytes;
};
inline Layout raw_layout(Kind k) {
  switch (k) {
    case kQ5_0: return {32, 22};
    case kQ5_1: return {32, 24};
    case kQ4_K: return {256, 144};
    case kQ5_K: return {256, 176};
    case kQ6_K: return {256, 210};
    default: return {32, 0};  // q4_1 / q8_0 come as separate qs, d, m tensors
  }
}

inline float half_at(const uint8_t* p) {
  c10::Half h;
  std::memcpy(&h.x, p, 2);
  return static_cast<float>(h);
}

struct Group {
  int nblocks;       // blocks of 32 in this group (1..8)
  bool is_signed;    // q holds int8 values (else 0..63, read as uint8)
  bool scaled16;     // s16 holds Q6_K's per-16 integer scales (else all ones)
  alignas(64) int8_t q[256];
  float a[8], c[8];
  int16_t s16[16];
};

// One weight row: q4_1 / q8_0 as split tensors (qs, d, m), other kinds as raw GGUF bytes.
struct Row {
  Kind kind;
  const uint8_t* qs;
  const at::Half* d;
  const at::Half* m;
};

inline void set_unscaled(Group& g) {
  g.scaled16 = false;
  for (int i = 0; i < 16; ++i) g.s16[i] = 1;
}

inline void scale_min_k4(int j, const uint8_t* s, int* sc, int* mn) {
  if (j < 4) {
    *sc = s[j] & 63;
    *mn = s[j + 4] & 63;
  } else {
    *sc = (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4);
    *mn = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

// Unpacks group `gi` (blocks [8 gi, 8 gi + 8) of the row, fewer at the end: nb blocks in all).
inline void unpack(const Row& r, int64_t gi, int64_t nb, Group& g) {
  const int64_t b0 = gi * 8;
  const int n = static_cast<int>(nb - b0 < 8 ? nb - b0 : 8);
  g.nblocks = n;
  set_unscaled(g);
  uint8_t* uq = reinterpret_cast<uint8_t*>(g.q);
  switch (r.kind) {
    case kQ4_1:
      g.is_signed = false;
      for (int b = 0; b < n; ++b) {
        const uint8_t* q = r.qs + (b0 + b) * 16;
        for (int j = 0; j < 16; ++j) {
          uq[b * 32 + j] = q[j] & 15;
          uq[b * 32 + 16 + j] = q[j] >> 4;
        }
        g.a[b] = static_cast<float>(r.d[b0 + b]);
        g.c[b] = static_cast<float>(r.m[b0 + b]);
      }
      return;
    case kQ8_0:
      g.is_signed = true;
      std::memcpy(g.q, r.qs + b0 * 32, n * 32);
      for (int b = 0; b < n; ++b) {
        g.a[b] = static_cast<float>(r.d[b0 + b]);
        g.c[b] = 0.f;
      }
      return;
    case kQ5_0:
    case kQ5_1: {
      const bool has_m = r.kind == kQ5_1;
      const int64_t size = has_m ? 24 : 22;
      g.is_signed = false;
      for (int b = 0; b < n; ++b) {
        const uint8_t* p = r.qs + (b0 + b) * size;
        const float d = half_at(p);
        const uint8_t* hp = p + (has_m ? 4 : 2);
        const uint32_t qh = hp[0] | (hp[1] << 8) | (hp[2] << 16) | (uint32_t(hp[3]) << 24);
        const uint8_t* q = hp + 4;
        for (int j = 0; j < 16; ++j) {
          uq[b * 32 + j] = (q[j] & 15) | (((qh >> j) & 1) << 4);
          uq[b * 32 + 16 + j] = (q[j] >> 4) | (((qh >> (j + 16)) & 1) << 4);
        }
        g.a[b] = d;
        g.c[b] = has_m ? half_at(p + 2) : -16.f * d;  // Q5_0: d * (q - 16)
      }
      return;
    }
    case kQ4_K:
    case kQ5_K: {
      const bool five = r.kind == kQ5_K;
      const uint8_t* p = r.qs + gi * (five ? 176 : 144);
      const float d = half_at(p), dmin = half_at(p + 2);
      const uint8_t* scales = p + 4;
      const uint8_t* qh = p + 16;
      const uint8_t* ql = p + (five ? 48 : 16);
      g.is_signed = false;
      for (int c = 0; c < 4; ++c) {  // 64 values: sub-block 2c (low nibbles), 2c + 1 (high)
        for (int l = 0; l < 32; ++l) {
          uint8_t lo = ql[32 * c + l] & 15, hi = ql[32 * c + l] >> 4;
          if (five) {
            lo |= ((qh[l] >> (2 * c)) & 1) << 4;
            hi |= ((qh[l] >> (2 * c + 1)) & 1) << 4;
          }
          uq[64 * c + l] = lo;
          uq[64 * c + 32 + l] = hi;
        }
      }
      for (int j = 0; j < 8; ++j) {
        int sc, mn;
        scale_min_k4(j, scales, &sc, &mn);
        g.a[j] = d * sc;
        g.c[j] = -dmin * mn;
      }
      return;
    }
    case kQ6_K: {
      const uint8_t* p = r.qs + gi * 210;
      const uint8_t* ql = p;
      const uint8_t* qh = p + 128;
      const int8_t* sc = reinterpret_cast<const int8_t*>(p + 192);
      const float d = half_at(p + 208);
      g.is_signed = true;
      g.scaled16 = true;
      for (int h = 0; h < 2; ++h) {  // two halves of 128 values
        const uint8_t* L = ql + 64 * h;
        const uint8_t* H = qh + 32 * h;
        int8_t* q = g.q + 128 * h;
        for (int l = 0; l < 32; ++l) {
          q[l] = static_cast<int8_t>(((L[l] & 15) | ((H[l] & 3) << 4)) - 32);
          q[l + 32] = static_cast<int8_t>(((L[l + 32] & 15) | (((H[l] >> 2) & 3) << 4)) - 32);
          q[l + 64] = static_cast<int8_t>(((L[l] >> 4) | (((H[l] >> 4) & 3) << 4)) - 32);
          q[l + 96] = static_cast<int8_t>(((L[l + 32] >> 4) | (((H[l] >> 6) & 3) << 4)) - 32);
        }
      }
      for (int i = 0; i < 16; ++i) g.s16[i] = sc[i];
      for (int j = 0; j < 8; ++j) {
        g.a[j] = d;
        g.c[j] = 0.f;
      }
      return;
    }
  }
}

}  // namespace airserve_blocks
