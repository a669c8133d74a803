// Paged decode attention on the host CPU: one new token per sequence, float32 queries and
// arithmetic over a float32, bfloat16, float16 or int8 KV cache (16-bit rows are widened to
// float32 as they are read: half the bytes of the memory-bound part, the same arithmetic).
//
// An int8 cache row of one head is D int8 values and, after them, the float32 scale of that
// (token, head): value = q * scale, symmetric, scale = max|x| / 127 (`quantize_head`). Scores
// are the int8 rows' dot products times the key's scale; the softmax weights are multiplied by
// each value row's scale before the weighted sum. A quarter of a float32 cache's bytes (plus 4
// per row) where decode attention's time is its memory reads; OpenVINO's CPU plugin keeps its
// cache in 8 bits by default for the same reason.
//
// Writes the new token's K/V into the pool at out_cache_loc, then attends each query over the
// first seq_lens[b] positions of its block table (the padded tail is never read).
//
// Work is a line of sequences, one unit per cached position; the line is cut into one equal
// piece per thread, so a long sequence at batch size 1 is split over the threads (split-K, the
// parts merged afterwards) and a batch of ragged lengths is balanced by tokens. A sequence is
// walked once, in chunks of kChunk tokens (the next chunk's scattered rows prefetched meanwhile);
// per KV head, the chunk's scores for all query heads of the group (four tokens share one
// horizontal reduction, and up to three query heads share each K row as it is loaded), their
// softmax against a running maximum (online softmax), then the weighted sum of the chunk's V
// rows (again shared by the group's heads). Each K/V row is read from memory once. Small calls
// run on the calling thread: waking the pool costs more than their arithmetic.
//
// The vector loops (decode_attention_simd.inc) are compiled twice through target options,
// whatever the build machine is: eight lanes for AVX2+FMA, sixteen for AVX-512F. At run time the
// best the CPU has is chosen whose lanes divide the head size; otherwise plain C++ loops run
// (set_attention_isa narrows the choice for tests). With AVX-512, the group's whole output (up
// to 3 heads x 64 floats) stays in registers while V rows stream past once. Measured on a
// 2-core AMD EPYC with AVX-512 (W2 shapes: 64 rows of 192 positions, 9 query over 3 KV heads of
// 64, 30 layers): with the rows in cache the step's attention takes 11.9 ms (float32 cache) and
// 6.9 ms (bf16) against 14.6 and 11.2 ms for the AVX2 loops; from memory 22 and 18 ms against
// 25 and 18: there the memory reads, not the arithmetic, set the time.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

#include "cpu_common.h"
#include "isa_select.h"

#if (defined(__x86_64__) || defined(_M_X64)) && defined(__GNUC__) && !defined(__clang__)
#include <immintrin.h>
#define AIRSERVE_ATTN_AVX2 1
#endif

namespace {

constexpr int64_t kChunk = 64;  // tokens per chunk: its V rows of one head stay in L1
// Prefill attention: keys per block, and query tokens per task (a block's width, so that only a
// task's last block crosses the causal diagonal).
constexpr int64_t kPrefillKeys = 64;
constexpr int64_t kPrefillQueries = 64;
// Below this many (token x KV head) positions a call runs on one thread: on a 2-core AVX2 EPYC
// waking the pool costs a few microseconds, about the arithmetic of this many positions.
constexpr int64_t kParallelMinWork = 1024;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// A KV cache element: float, bfloat16 held as its 16 bits (the high half of a float), or
// IEEE half (c10::Half).
using bf16_t = uint16_t;
using f16_t = c10::Half;

// Bytes after an int8 head row: its float32 scale.
constexpr int64_t kInt8ScaleBytes = 4;
template <typename T>
constexpr int64_t head_extra() { return std::is_same<T, int8_t>::value ? kInt8ScaleBytes : 0; }

// The scale stored after an int8 head row of D values.
inline float row_scale(const int8_t* head_row, int64_t dim) {
  float s;
  std::memcpy(&s, head_row + dim, sizeof s);
  return s;
}

// x[0..D) as int8 values and their scale at dst[D..D+4): symmetric, scale = max|x| / 127,
// rounded to nearest even (a row of zeros gets scale 0). The one definition of the cache's
// int8 rows: the decode write, quantize_kv_cpu (prefill's write) and the tests use it.
inline void quantize_head(const float* x, int64_t dim, int8_t* dst) {
  float amax = 0.f;
  for (int64_t d = 0; d < dim; ++d) amax = std::max(amax, std::fabs(x[d]));
  const float scale = amax / 127.f;
  const float inv = amax > 0.f ? 127.f / amax : 0.f;
  for (int64_t d = 0; d < dim; ++d) {
    const float r = std::nearbyint(x[d] * inv);
    dst[d] = static_cast<int8_t>(std::min(127.f, std::max(-127.f, r)));
  }
  std::memcpy(dst + dim, &scale, sizeof scale);
}

inline float widen(float x) { return x; }
inline float widen(bf16_t x) { return airserve_cpu::bf16_value(x); }

inline float widen(f16_t x) { return static_cast<float>(x); }
inline float widen(int8_t x) { return static_cast<float>(x); }  // times the row's scale, later

inline void narrow(float x, float* to) { *to = x; }
// Round to nearest even, as torch's float -> float16 conversion does (c10's own conversion).
inline void narrow(float x, f16_t* to) { *to = f16_t(x); }
// Round to nearest even, as torch's float -> bfloat16 conversion does (NaN stays a NaN).
inline void narrow(float x, bf16_t* to) { *to = airserve_cpu::bf16_bits(x); }

// What one sequence reads: all its KV heads. Rows are `row` elements apart in the pool, heads
// `hstride` apart within a row (dim, plus an int8 row's scale).
template <typename T>
struct Segment {
  const float* q;  // [KVH * group, D], already multiplied by the scale
  const T* kc;     // pool base (+ head offset in a one-head view)
  const T* vc;
  const int32_t* table;  // this sequence's block table
  int64_t page_size, row, group, dim, hstride;

  // The view of KV head h alone.
  Segment head(int64_t h) const {
    return {q + h * group * dim, kc + h * hstride, vc + h * hstride, table, page_size, row,
            group, dim, hstride};
  }
};

// Running state of softmaxes: max, sum of e^(s - max), unnormalized output, per query head.
struct Partial {
  float* m;  // [heads]
  float* l;  // [heads]
  float* o;  // [heads, D]

  Partial head(int64_t h, int64_t group, int64_t dim) const {
    return {m + h * group, l + h * group, o + h * group * dim};
  }
};

// Pool offsets (in elements, before the head offset) of tokens [t0, t0 + n).
template <typename T>
inline void gather_rows(const Segment<T>& s, int64_t t0, int64_t n, int64_t* off) {
  if (s.page_size == 1) {
    for (int64_t j = 0; j < n; ++j) off[j] = int64_t(s.table[t0 + j]) * s.row;
    return;
  }
  for (int64_t j = 0; j < n; ++j) {
    const int64_t t = t0 + j;
    off[j] = (int64_t(s.table[t / s.page_size]) * s.page_size + t % s.page_size) * s.row;
  }
}

// Rows to ask for while a chunk is computed: the next chunk's (or the next sequence's first),
// at pool offsets `off` (before the head offset).
struct Ahead {
  const int64_t* off = nullptr;
  int64_t n = 0;
};

// Asks for one head's `dim` elements at p to be brought into cache.
template <typename T>
inline void prefetch_head(const T* p, int64_t dim) {
  const char* c = reinterpret_cast<const char*>(p);
  const int64_t bytes = dim * int64_t(sizeof(T)) + head_extra<T>();
  for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(c + b, 0, 2);
  __builtin_prefetch(c + bytes - 1, 0, 2);
}

// Asks for the K and V rows (all heads) at `off` to be brought into L2 at once: a chunk's rows
// are scattered over the pool, which the hardware prefetchers cannot guess.
template <typename T>
inline void prefetch_rows(const Segment<T>& s, const int64_t* off, int64_t n) {
  const int64_t bytes = s.row * int64_t(sizeof(T));
  for (int64_t j = 0; j < n; ++j) {
    const char* k = reinterpret_cast<const char*>(s.kc + off[j]);
    const char* v = reinterpret_cast<const char*>(s.vc + off[j]);
    for (int64_t b = 0; b < bytes; b += 64) {
      __builtin_prefetch(k + b, 0, 2);
      __builtin_prefetch(v + b, 0, 2);
    }
  }
}

// Instruction sets, best first; g_isa holds an index into kIsaNames.
enum Isa : int { kAvx512 = 0, kAvx2 = 1, kScalar = 2 };

#ifdef AIRSERVE_ATTN_AVX2
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
namespace attn_avx2 {
#include "decode_attention_avx2.inc"
#include "prefill_attention_simd.inc"
}  // namespace attn_avx2
#pragma GCC pop_options
#pragma GCC push_options
#pragma GCC target("avx512f,avx2,fma,f16c")
namespace attn_avx512 {
using attn_avx2::exp_shifted;
#include "decode_attention_avx512.inc"
#include "prefill_attention_simd.inc"
}  // namespace attn_avx512
#pragma GCC pop_options
#endif  // AIRSERVE_ATTN_AVX2

// The largest of p[0..n), n >= 1: eight-lane compares where the vector loops run, else a scan.
inline float row_max(const float* p, int64_t n, int isa) {
#ifdef AIRSERVE_ATTN_AVX2
  if (isa != kScalar) return attn_avx2::max_of(p, n);
#else
  (void)isa;
#endif
  return *std::max_element(p, p + n);
}

// The same three steps in plain C++: any CPU, any head size.
template <typename T>
void chunk_scores_portable(const Segment<T>& s, const int64_t* off, int64_t n, float* sc) {
  for (int64_t j = 0; j < n; ++j) {
    const T* k = s.kc + off[j];
    for (int64_t g = 0; g < s.group; ++g) {
      const float* q = s.q + g * s.dim;
      float acc = 0.f;
      for (int64_t d = 0; d < s.dim; ++d) acc += q[d] * widen(k[d]);
      sc[g * kChunk + j] = acc;
    }
  }
}

float exp_shifted_portable(float* p, int64_t n, float mx) {
  float total = 0.f;
  for (int64_t j = 0; j < n; ++j) total += (p[j] = std::exp(p[j] - mx));
  return total;
}

template <typename T>
void chunk_values_portable(const Segment<T>& s, const int64_t* off, int64_t n, const float* w,
                           float* o) {
  for (int64_t j = 0; j < n; ++j) {
    const T* v = s.vc + off[j];
    for (int64_t g = 0; g < s.group; ++g) {
      float* og = o + g * s.dim;
      const float p = w[g * kChunk + j];
      for (int64_t d = 0; d < s.dim; ++d) og[d] += p * widen(v[d]);
    }
  }
}

// sc[g * kChunk + j] *= the scale of int8 row j (at cache + off[j]), for every query head g.
inline void scale_by_rows(const int8_t* cache, const int64_t* off, int64_t n,
                          const Segment<int8_t>& s, float* sc) {
  float scales[kChunk];
  for (int64_t j = 0; j < n; ++j) scales[j] = row_scale(cache + off[j], s.dim);
  for (int64_t g = 0; g < s.group; ++g)
    for (int64_t j = 0; j < n; ++j) sc[g * kChunk + j] *= scales[j];
}

// Folds tokens [t0, t1) of one KV head's chunk into `acc`.
template <typename T>
void attend_chunk(const Segment<T>& s, const int64_t* off, int64_t n, float* sc,
                  const Partial& acc, int isa, const Ahead& ahead) {
#ifdef AIRSERVE_ATTN_AVX2
  if (isa == kAvx512) attn_avx512::chunk_scores(s, off, n, sc, ahead);
  else if (isa == kAvx2) attn_avx2::chunk_scores(s, off, n, sc, ahead);
  else
#endif
    chunk_scores_portable(s, off, n, sc);
  if constexpr (std::is_same<T, int8_t>::value) scale_by_rows(s.kc, off, n, s, sc);
  for (int64_t g = 0; g < s.group; ++g) {
    float* p = sc + g * kChunk;
    const float mx = std::max(acc.m[g], row_max(p, n, isa));
    // The first chunk rescales nothing: e^(-inf - mx) = 0 times an o of zeros.
    const float correction = std::exp(acc.m[g] - mx);
#ifdef AIRSERVE_ATTN_AVX2
    const float sum = isa != kScalar ? attn_avx2::exp_shifted(p, n, mx)
                                     : exp_shifted_portable(p, n, mx);
#else
    const float sum = exp_shifted_portable(p, n, mx);
#endif
    acc.l[g] = acc.l[g] * correction + sum;
    acc.m[g] = mx;
    if (correction != 1.f)
      for (int64_t d = 0; d < s.dim; ++d) acc.o[g * s.dim + d] *= correction;
  }
  // The weights (their sum is counted above) times each value row's scale.
  if constexpr (std::is_same<T, int8_t>::value) scale_by_rows(s.vc, off, n, s, sc);
#ifdef AIRSERVE_ATTN_AVX2
  if (isa == kAvx512) attn_avx512::chunk_values(s, off, n, sc, acc.o, ahead);
  else if (isa == kAvx2) attn_avx2::chunk_values(s, off, n, sc, acc.o, ahead);
  else
#endif
    chunk_values_portable(s, off, n, sc, acc.o);
}

// Folds tokens [t0, t1) of a sequence, every KV head, into `acc` (which starts at m = -inf,
// l = 0, o = 0), chunk by chunk. The next chunk's rows (after the last chunk: the first of
// `after`, the next sequence, if given) are fetched while one is computed: the vector loops ask
// for them row by row as they use the current chunk's, which keeps the reads flowing at the pace
// of the arithmetic (a whole chunk asked for at once, 48-96 KB, fills the core's queue of
// outstanding misses and stalls it: measured, the reads then add to the arithmetic instead of
// overlapping it); the plain loops ask for the whole chunk at once. `fetched`: the first
// chunk's rows were asked for already.
template <typename T>
void attend(const Segment<T>& s, int64_t kvh, int64_t t0, int64_t t1, const Partial& acc,
            int isa, bool fetched, const Segment<T>* after, int64_t after_n) {
  int64_t offsets[3][kChunk];
  // Scores of one chunk for a group; thread-local so no call allocates after warm-up.
  thread_local std::vector<float> buffer;
  buffer.resize(s.group * kChunk);
  int64_t n = std::min(kChunk, t1 - t0);
  gather_rows(s, t0, n, offsets[0]);
  if (!fetched) prefetch_rows(s, offsets[0], n);
  for (int64_t c = t0, i = 0; c < t1; c += kChunk, i ^= 1) {
    const int64_t next = std::min(kChunk, t1 - c - n);
    Ahead ahead;
    if (next > 0) {
      gather_rows(s, c + n, next, offsets[i ^ 1]);
      ahead = {offsets[i ^ 1], next};
    } else if (after != nullptr && after_n > 0) {
      gather_rows(*after, 0, after_n, offsets[2]);
      ahead = {offsets[2], after_n};
    }
    if (isa == kScalar) {
      prefetch_rows(s, ahead.off, ahead.n);
      ahead = Ahead{};
    }
    for (int64_t h = 0; h < kvh; ++h)
      attend_chunk(s.head(h), offsets[i], n, buffer.data(), acc.head(h, s.group, s.dim), isa,
                   ahead);
    n = next;
  }
}

inline void reset(const Partial& p, int64_t heads, int64_t dim) {
  std::fill_n(p.m, heads, kNegInf);
  std::fill_n(p.l, heads, 0.f);
  std::fill_n(p.o, heads * dim, 0.f);
}

// Sets `into` to the softmax-weighted combination of two partials of the same sequence.
void merge(const Partial& into, const Partial& from, int64_t heads, int64_t dim) {
  for (int64_t g = 0; g < heads; ++g) {
    const float mx = std::max(into.m[g], from.m[g]);
    const float a = std::exp(into.m[g] - mx), b = std::exp(from.m[g] - mx);
    into.l[g] = into.l[g] * a + from.l[g] * b;
    into.m[g] = mx;
    for (int64_t d = 0; d < dim; ++d)
      into.o[g * dim + d] = into.o[g * dim + d] * a + from.o[g * dim + d] * b;
  }
}

inline void normalize(const Partial& p, float* out, int64_t heads, int64_t dim) {
  for (int64_t g = 0; g < heads; ++g) {
    const float inv = 1.f / p.l[g];
    for (int64_t d = 0; d < dim; ++d) out[g * dim + d] = p.o[g * dim + d] * inv;
  }
}

// One call's shapes and pointers. Segment b of the work line is sequence b, seq_lens[b]
// positions long.
template <typename T>
struct Call {
  const float* qs;  // [bs, H, D] queries times the scale
  const T* kc;
  const T* vc;
  const int32_t* table;  // [bs, width]
  const int32_t* lens;   // [bs]
  float* out;            // [bs, H, D]
  int64_t width, page_size, kvh, group, dim;
  int isa;

  int64_t heads() const { return kvh * group; }
  int64_t hstride() const { return dim + head_extra<T>(); }
  Segment<T> segment(int64_t b) const {
    return {qs + b * heads() * dim, kc, vc, table + b * width, page_size, kvh * hstride(), group,
            dim, hstride()};
  }
  float* out_of(int64_t b) const { return out + b * heads() * dim; }
  int64_t state_size() const { return heads() * (dim + 2); }
  Partial partial(float* base) const { return {base, base + heads(), base + 2 * heads()}; }
};

// Runs the positions [bound[p], bound[p + 1]) of the work line. A segment that lies wholly in
// the piece is written to the output; one cut by the piece's edge is left in scratch slot
// 2p (the piece's first segment) or 2p + 1 (its last) for `merge_cut`.
template <typename T>
void run_piece(const Call<T>& c, const std::vector<int64_t>& start, const std::vector<int64_t>& bound,
               int64_t p, float* scratch) {
  thread_local std::vector<float> whole_state;
  whole_state.resize(c.state_size());
  const int64_t end = bound[p + 1];
  int64_t s = std::upper_bound(start.begin(), start.end(), bound[p]) - start.begin() - 1;
  for (int64_t pos = bound[p]; pos < end; pos = start[++s]) {
    const int64_t t0 = pos - start[s], t1 = std::min(start[s + 1], end) - start[s];
    const bool whole = t0 == 0 && t1 == start[s + 1] - start[s];
    float* base = whole ? whole_state.data()
                        : scratch + (2 * p + (pos == bound[p] ? 0 : 1)) * c.state_size();
    const Partial acc = c.partial(base);
    reset(acc, c.heads(), c.dim);
    // The next sequence's first rows are fetched during this one's last chunk.
    const bool more = start[s + 1] < end;
    const Segment<T> following = c.segment(more ? s + 1 : s);
    const int64_t following_n =
        more ? std::min(kChunk, std::min(start[s + 2], end) - start[s + 1]) : 0;
    attend(c.segment(s), c.kvh, t0, t1, acc, c.isa, pos != bound[p], more ? &following : nullptr,
           following_n);
    if (whole) normalize(acc, c.out_of(s), c.heads(), c.dim);
  }
}

// Combines the pieces' parts of every segment that a piece boundary cuts, into the output.
template <typename T>
void merge_cut(const Call<T>& c, const std::vector<int64_t>& start,
               const std::vector<int64_t>& bound, float* scratch) {
  const int64_t pieces = int64_t(bound.size()) - 1;
  int64_t last = -1;
  for (int64_t p = 1; p < pieces; ++p) {
    const int64_t s = std::upper_bound(start.begin(), start.end(), bound[p]) - start.begin() - 1;
    if (start[s] == bound[p] || s == last) continue;  // not cut here, or merged already
    last = s;
    // Pieces p0..p1 hold parts of s: p0 as its last segment, the others as their first.
    int64_t p0 = p - 1;
    while (p0 > 0 && bound[p0] > start[s]) --p0;
    const Partial into = c.partial(scratch + (2 * p0 + (bound[p0] == start[s] ? 0 : 1)) *
                                                 c.state_size());
    for (int64_t q = p; q < pieces && bound[q] < start[s + 1]; ++q)
      merge(into, c.partial(scratch + 2 * q * c.state_size()), c.heads(), c.dim);
    normalize(into, c.out_of(s), c.heads(), c.dim);
  }
}

// Cuts the work line into `pieces` runs of equal length, one per thread, and runs them.
template <typename T>
void run(const Call<T>& c, int64_t segments, int64_t pieces) {
  std::vector<int64_t> start(segments + 1, 0);
  for (int64_t i = 0; i < segments; ++i) start[i + 1] = start[i] + c.lens[i];
  std::vector<int64_t> bound(pieces + 1);
  for (int64_t p = 0; p <= pieces; ++p) bound[p] = start[segments] * p / pieces;
  if (pieces == 1) {
    run_piece(c, start, bound, 0, nullptr);
    return;
  }
  std::vector<float> scratch(2 * pieces * c.state_size());
  at::parallel_for(0, pieces, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) run_piece(c, start, bound, p, scratch.data());
  });
  merge_cut(c, start, bound, scratch.data());
}

const char* const kIsaNames[] = {"avx512", "avx2", "scalar"};
constexpr int kIsaCount = 3;
std::atomic<int> g_isa{-1};

bool isa_supported(int isa) {
#ifdef AIRSERVE_ATTN_AVX2
  __builtin_cpu_init();
  // F16C (half widening) came with AVX2 on every x86 CPU; checked all the same.
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                    __builtin_cpu_supports("f16c");
  if (isa == kAvx512) return avx2 && __builtin_cpu_supports("avx512f");
  if (isa == kAvx2) return avx2;
#endif
  return isa == kScalar;
}

int current_isa() { return airserve_isa::current(g_isa, kIsaCount, isa_supported); }

std::vector<std::string> attention_isas() {
  std::vector<std::string> names;
  for (int i = 0; i < kIsaCount; ++i)
    if (isa_supported(i)) names.emplace_back(kIsaNames[i]);
  return names;
}

std::string attention_isa() { return kIsaNames[current_isa()]; }

// Narrows the instruction set decode attention uses ("auto": the best this CPU has). For tests
// and benchmarks; returns the one now in use.
std::string set_attention_isa(const std::string& name) {
  if (name == "auto") {
    g_isa.store(airserve_isa::best(kIsaCount, isa_supported));
    return attention_isa();
  }
  for (int i = 0; i < kIsaCount; ++i) {
    if (name != kIsaNames[i]) continue;
    TORCH_CHECK(isa_supported(i), "airserve::set_attention_isa: this CPU (or compiler) lacks ",
                name);
    g_isa.store(i);
    return attention_isa();
  }
  TORCH_CHECK(false, "airserve::set_attention_isa: unknown instruction set '", name,
              "' (auto, avx512, avx2, scalar)");
}

// Writes each sequence's new K/V row into the cache (narrowed to its element type T), then
// attends every sequence.
template <typename T>
void attend_all(const float* qs, const float* kp, const float* vp, at::Tensor& k_cache,
                at::Tensor& v_cache, const int64_t* locp, const int32_t* tp, const int32_t* lp,
                float* op, int64_t bs, int64_t width, int64_t page_size, int64_t kvh,
                int64_t group, int64_t dim, int isa, int64_t pieces) {
  T* kc = static_cast<T*>(k_cache.data_ptr());
  T* vc = static_cast<T*>(v_cache.data_ptr());
  const int64_t row = kvh * dim;
  if constexpr (std::is_same<T, int8_t>::value) {
    const int64_t hs = dim + head_extra<T>();
    for (int64_t b = 0; b < bs; ++b)
      for (int64_t h = 0; h < kvh; ++h) {
        quantize_head(kp + b * row + h * dim, dim, kc + (locp[b] * kvh + h) * hs);
        quantize_head(vp + b * row + h * dim, dim, vc + (locp[b] * kvh + h) * hs);
      }
  } else {
    for (int64_t b = 0; b < bs; ++b)
      for (int64_t i = 0; i < row; ++i) {
        narrow(kp[b * row + i], kc + locp[b] * row + i);
        narrow(vp[b * row + i], vc + locp[b] * row + i);
      }
  }
  const Call<T> call{qs, kc, vc, tp, lp, op, width, page_size, kvh, group, dim, isa};
  run(call, bs, pieces);
}

template <typename T>
const T* typed(const at::Tensor& t, at::ScalarType type, at::Tensor& keep) {
  keep = (t.scalar_type() == type && t.is_contiguous()) ? t : t.to(type).contiguous();
  return keep.data_ptr<T>();
}

at::Tensor paged_decode_attention_cpu(const at::Tensor& q_in, const at::Tensor& k_in,
                                      const at::Tensor& v_in, at::Tensor& k_cache,
                                      at::Tensor& v_cache, const at::Tensor& out_cache_loc,
                                      const at::Tensor& block_table_in,
                                      const at::Tensor& seq_lens_in, int64_t page_size,
                                      double scale) {
  const char* name = "airserve::paged_decode_attention_cpu";
  const at::ScalarType kv_type = k_cache.scalar_type();
  TORCH_CHECK(q_in.scalar_type() == at::kFloat &&
                  (kv_type == at::kFloat || kv_type == at::kBFloat16 ||
                   kv_type == at::kHalf || kv_type == at::kChar) &&
                  v_cache.scalar_type() == kv_type,
              name, ": float32 queries, and a float32, bfloat16, float16 or int8 KV cache");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.dim() == 3 &&
                  v_cache.sizes() == k_cache.sizes(),
              name, ": the KV buffers must be contiguous [num_slots, KVH, D]");
  TORCH_CHECK(q_in.dim() == 3 && block_table_in.dim() == 2 && page_size >= 1, name,
              ": q must be [bs, H, D], block_table [bs, max_blocks], page_size >= 1");
  at::Tensor q_keep, k_keep, v_keep, loc_keep, table_keep, lens_keep;
  const float* qp = typed<float>(q_in, at::kFloat, q_keep);
  const float* kp = typed<float>(k_in, at::kFloat, k_keep);
  const float* vp = typed<float>(v_in, at::kFloat, v_keep);
  const int64_t* locp = typed<int64_t>(out_cache_loc, at::kLong, loc_keep);
  const int32_t* tp = typed<int32_t>(block_table_in, at::kInt, table_keep);
  const int32_t* lp = typed<int32_t>(seq_lens_in, at::kInt, lens_keep);
  const int64_t bs = q_in.size(0), H = q_in.size(1), D = q_in.size(2);
  const int64_t KVH = k_cache.size(1), slots = k_cache.size(0);
  const int64_t width = block_table_in.size(1);
  const int64_t extra = kv_type == at::kChar ? kInt8ScaleBytes : 0;
  TORCH_CHECK(H % KVH == 0 && k_cache.size(2) == D + extra, name,
              ": head shapes do not match (an int8 cache's rows are D + 4 bytes: the values, "
              "then their float32 scale)");
  TORCH_CHECK(out_cache_loc.numel() == bs && seq_lens_in.numel() == bs &&
                  block_table_in.size(0) == bs && k_in.numel() == bs * KVH * D &&
                  v_in.numel() == bs * KVH * D,
              name, ": k, v, out_cache_loc, block_table and seq_lens must have bs rows");
  const int64_t group = H / KVH, row = KVH * D, pages = slots / page_size;
  int64_t total = 0;  // work: cached positions over all (sequence, KV head) segments
  for (int64_t b = 0; b < bs; ++b) {
    TORCH_CHECK(locp[b] >= 0 && locp[b] < slots, name, ": out_cache_loc out of range");
    TORCH_CHECK(lp[b] >= 1 && lp[b] <= width * page_size, name, ": seq_lens[", b, "]=", lp[b],
                " does not fit the block table");
    const int64_t blocks = (lp[b] + page_size - 1) / page_size;
    for (int64_t i = 0; i < blocks; ++i)
      TORCH_CHECK(tp[b * width + i] >= 0 && tp[b * width + i] < pages, name,
                  ": block_table[", b, ", ", i, "]=", tp[b * width + i], " is not a page");
    total += int64_t(lp[b]) * KVH;
  }
  at::Tensor out = at::empty({bs, H, D}, q_in.options());
  float* op = out.data_ptr<float>();
  // The queries times the scale, so scores need no multiply.
  std::vector<float> qs(bs * H * D);
  const float sc = static_cast<float>(scale);
  for (int64_t i = 0; i < bs * H * D; ++i) qs[i] = qp[i] * sc;
  // The vector loops take whole vectors of a head: a head size they do not divide steps down.
  int isa = current_isa();
  if (isa == kAvx512 && D % 16 != 0) isa = kAvx2;
  if (isa == kAvx2 && D % 8 != 0) isa = kScalar;
  const int64_t pieces = total < kParallelMinWork ? 1
                                                  : std::min<int64_t>(at::get_num_threads(),
                                                                      total / KVH);
  if (kv_type == at::kFloat) {
    attend_all<float>(qs.data(), kp, vp, k_cache, v_cache, locp, tp, lp, op, bs, width,
                      page_size, KVH, group, D, isa, pieces);
  } else if (kv_type == at::kBFloat16) {
    attend_all<bf16_t>(qs.data(), kp, vp, k_cache, v_cache, locp, tp, lp, op, bs, width,
                       page_size, KVH, group, D, isa, pieces);
  } else if (kv_type == at::kHalf) {
    attend_all<f16_t>(qs.data(), kp, vp, k_cache, v_cache, locp, tp, lp, op, bs, width,
                      page_size, KVH, group, D, isa, pieces);
  } else {
    attend_all<int8_t>(qs.data(), kp, vp, k_cache, v_cache, locp, tp, lp, op, bs, width,
                       page_size, KVH, group, D, isa, pieces);
  }
  return out;
}

// [T, KVH, D] float32 -> [T, KVH, D + 4] int8: each head's values and scale as the int8 cache
// holds them (quantize_head), for prefill's write into the pool.
at::Tensor quantize_kv_cpu(const at::Tensor& x_in) {
  TORCH_CHECK(x_in.dim() == 3, "airserve::quantize_kv_cpu: x must be [T, KVH, D]");
  at::Tensor keep;
  const float* x = typed<float>(x_in, at::kFloat, keep);
  const int64_t T = x_in.size(0), KVH = x_in.size(1), D = x_in.size(2);
  at::Tensor out = at::empty({T, KVH, D + kInt8ScaleBytes}, x_in.options().dtype(at::kChar));
  int8_t* o = out.data_ptr<int8_t>();
  at::parallel_for(0, T * KVH, 256, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) quantize_head(x + i * D, D, o + i * (D + kInt8ScaleBytes));
  });
  return out;
}


// ---- Prefill attention: a sequence's new tokens over its cached prefix and themselves ----
//
// Sequence b's new tokens q[q_starts[b] + j], j < new_lens[b], sit at positions prefix_lens[b]
// + j and attend causally over keys k[k_starts[b] + i], i <= prefix_lens[b] + j (the prefix's
// keys and the new ones, in order); out (q's shape) receives them. torch's flash kernel took
// ~1.5 ms a layer on W2's prefill (4 prompts x 128 tokens, 9 query / 3 KV heads of 64, 2
// threads, AMD EPYC with AVX-512; this operator ~0.75 ms): its blocks are sized for long
// sequences and each query head reads the group's keys again. Here a task is one (sequence, KV
// head, block of up to kPrefillQueries positions): the block's rows (position x the group's
// query heads) meet the keys kPrefillKeys at a time, transposed once per block so every loaded
// vector of keys serves several rows; an online softmax per row carries the blocks. In the
// block on a task's diagonal each group of rows stops at the last key its last row sees (about
// half the block's products; W2's 128-token prompts have two diagonal blocks of three), and the
// rows' maxima take eight-lane compares. Key blocks
// start at whole multiples of kPrefillKeys from the sequence's first key, and no row's
// arithmetic depends on the other rows of its task, so a token's output is the same bits
// whether its prompt ran whole, in chunks, or after a cache hit. Tasks are taken longest first
// from a shared counter, which balances the causal triangle's uneven tasks over the threads.

struct PrefillCall {
  const float* q;
  const float* k;
  const float* v;
  float* out;
  int64_t q_stride, k_stride, v_stride;  // floats between two tokens' rows
  int64_t kvh, group, dim;
  float scale;
  int isa;
};

// Positions [p0, p1) of one sequence under one KV head; its first query row and first key.
struct PrefillTask {
  int64_t q_start, k_start, prefix, head, p0, p1;
};

// Scratch of one thread: the query rows times the scale, one block's transposed keys and
// scores, and the rows' running softmax state.
struct PrefillScratch {
  std::vector<float> q, kt, s, m, l, o;
  void size(int64_t rows, int64_t dim) {
    q.resize(rows * dim);
    kt.resize(dim * kPrefillKeys);
    s.resize(rows * kPrefillKeys);
    m.resize(rows);
    l.resize(rows);
    o.resize(rows * dim);
  }
};

void prefill_scores_portable(const float* q, int64_t rows, int64_t D, const float* kt,
                             float* s) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t j = 0; j < kPrefillKeys; ++j) {
      float acc = 0.f;
      for (int64_t d = 0; d < D; ++d) acc += q[r * D + d] * kt[d * kPrefillKeys + j];
      s[r * kPrefillKeys + j] = acc;
    }
}

void prefill_values_portable(const float* p, int64_t rows, const float* v, int64_t vstride,
                             int64_t n, float* o, int64_t D) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t j = 0; j < n; ++j) {
      const float w = p[r * kPrefillKeys + j];
      for (int64_t d = 0; d < D; ++d) o[r * D + d] += w * v[j * vstride + d];
    }
}

void prefill_task(const PrefillCall& c, const PrefillTask& t, PrefillScratch& w) {
  const int64_t D = c.dim, G = c.group, H = c.kvh * G;
  const int64_t rows = (t.p1 - t.p0) * G;
  w.size(rows, D);
  // Row r is position p0 + r / G under query head head * G + r % G.
  const auto q_row = [&](int64_t r) {
    return (t.q_start + t.p0 + r / G - t.prefix) * c.q_stride + (t.head * G + r % G) * D;
  };
  for (int64_t r = 0; r < rows; ++r) {
    const float* src = c.q + q_row(r);
    for (int64_t d = 0; d < D; ++d) w.q[r * D + d] = src[d] * c.scale;
  }
  std::fill(w.m.begin(), w.m.end(), kNegInf);
  std::fill(w.l.begin(), w.l.end(), 0.f);
  std::fill(w.o.begin(), w.o.end(), 0.f);
  for (int64_t c0 = 0; c0 < t.p1; c0 += kPrefillKeys) {
    const int64_t nk = std::min(kPrefillKeys, t.p1 - c0);
    const float* kb = c.k + (t.k_start + c0) * c.k_stride + t.head * D;
    for (int64_t d = 0; d < D; ++d) {
      float* row = w.kt.data() + d * kPrefillKeys;
      for (int64_t j = 0; j < nk; ++j) row[j] = kb[j * c.k_stride + d];
      std::fill(row + nk, row + kPrefillKeys, 0.f);
    }
    const int64_t lead = t.p0 - c0 + 1;  // keys of this block that its first row sees
#ifdef AIRSERVE_ATTN_AVX2
    if (c.isa == kAvx512)
      attn_avx512::prefill_scores(w.q.data(), rows, D, w.kt.data(), w.s.data(), lead, G);
    else if (c.isa == kAvx2)
      attn_avx2::prefill_scores(w.q.data(), rows, D, w.kt.data(), w.s.data(), lead, G);
    else
#endif
      prefill_scores_portable(w.q.data(), rows, D, w.kt.data(), w.s.data());
    for (int64_t r = 0; r < rows; ++r) {
      float* p = w.s.data() + r * kPrefillKeys;
      // Position p0 + r / G sees keys up to itself: none of a block past it.
      const int64_t valid = std::min(nk, t.p0 + r / G - c0 + 1);
      if (valid <= 0) {
        std::fill(p, p + nk, 0.f);
        continue;
      }
      const float mx = std::max(w.m[r], row_max(p, valid, c.isa));
      const float correction = std::exp(w.m[r] - mx);  // 0 for the first block: o is zero
#ifdef AIRSERVE_ATTN_AVX2
      const float sum = c.isa != kScalar ? attn_avx2::exp_shifted(p, valid, mx)
                                         : exp_shifted_portable(p, valid, mx);
#else
      const float sum = exp_shifted_portable(p, valid, mx);
#endif
      std::fill(p + valid, p + nk, 0.f);
      w.l[r] = w.l[r] * correction + sum;
      w.m[r] = mx;
      if (correction != 1.f)
        for (int64_t d = 0; d < D; ++d) w.o[r * D + d] *= correction;
    }
    const float* vb = c.v + (t.k_start + c0) * c.v_stride + t.head * D;
#ifdef AIRSERVE_ATTN_AVX2
    if (c.isa == kAvx512)
      attn_avx512::prefill_values(w.s.data(), rows, vb, c.v_stride, nk, w.o.data(), D, lead, G);
    else if (c.isa == kAvx2)
      attn_avx2::prefill_values(w.s.data(), rows, vb, c.v_stride, nk, w.o.data(), D, lead, G);
    else
#endif
      prefill_values_portable(w.s.data(), rows, vb, c.v_stride, nk, w.o.data(), D);
  }
  for (int64_t r = 0; r < rows; ++r) {
    float* dst = c.out + (t.q_start + t.p0 + r / G - t.prefix) * H * D + (t.head * G + r % G) * D;
    const float inv = 1.f / w.l[r];
    for (int64_t d = 0; d < D; ++d) dst[d] = w.o[r * D + d] * inv;
  }
}

void prefill_attention_cpu(at::Tensor& out, const at::Tensor& q, const at::Tensor& k,
                           const at::Tensor& v, at::IntArrayRef q_starts,
                           at::IntArrayRef k_starts, at::IntArrayRef prefix_lens,
                           at::IntArrayRef new_lens, double scale) {
  const char* name = "airserve::prefill_attention_cpu";
  TORCH_CHECK(q.scalar_type() == at::kFloat && k.scalar_type() == at::kFloat &&
                  v.scalar_type() == at::kFloat && out.scalar_type() == at::kFloat,
              name, ": float32 q, k, v and out");
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3 && out.dim() == 3, name,
              ": q and out must be [T, H, D], k and v [N, KVH, D]");
  const int64_t T = q.size(0), H = q.size(1), D = q.size(2), KVH = k.size(1), N = k.size(0);
  TORCH_CHECK(out.sizes() == q.sizes() && out.is_contiguous(), name,
              ": out must be a contiguous tensor of q's shape");
  TORCH_CHECK(k.sizes() == v.sizes() && k.size(2) == D && KVH >= 1 && H % KVH == 0, name,
              ": k and v must be [N, KVH, D] with KVH dividing q's heads");
  for (const at::Tensor* t : {&q, &k, &v})
    TORCH_CHECK(t->stride(2) == 1 && t->stride(1) == D, name,
                ": each token's heads must be contiguous (stride D between heads)");
  const size_t seqs = q_starts.size();
  TORCH_CHECK(k_starts.size() == seqs && prefix_lens.size() == seqs && new_lens.size() == seqs,
              name, ": q_starts, k_starts, prefix_lens and new_lens differ in length");
  std::vector<PrefillTask> tasks;
  for (size_t b = 0; b < seqs; ++b) {
    const int64_t n = new_lens[b], prefix = prefix_lens[b], total = prefix + n;
    TORCH_CHECK(n >= 1 && prefix >= 0 && q_starts[b] >= 0 && q_starts[b] + n <= T, name,
                ": sequence ", b, "'s queries (start ", q_starts[b], ", ", n,
                " new tokens) do not fit q's ", T, " tokens");
    TORCH_CHECK(k_starts[b] >= 0 && k_starts[b] + total <= N, name, ": sequence ", b,
                "'s keys (start ", k_starts[b], ", ", total, ") do not fit k's ", N, " tokens");
    for (int64_t h = 0; h < KVH; ++h)
      for (int64_t p0 = prefix; p0 < total;) {
        // Blocks end at multiples of kPrefillQueries: only a block's last key block crosses
        // its rows' diagonal.
        const int64_t p1 = std::min(total, (p0 / kPrefillQueries + 1) * kPrefillQueries);
        tasks.push_back({q_starts[b], k_starts[b], prefix, h, p0, p1});
        p0 = p1;
      }
  }
  // Longest first: a task's work grows with its rows and its last position.
  const auto work_of = [](const PrefillTask& t) { return (t.p1 - t.p0) * t.p1; };
  std::stable_sort(tasks.begin(), tasks.end(), [&](const PrefillTask& a, const PrefillTask& b) {
    return work_of(a) > work_of(b);
  });
  int isa = current_isa();
  if (isa == kAvx512 && D % 16 != 0) isa = kAvx2;
  if (isa == kAvx2 && D % 8 != 0) isa = kScalar;
  const PrefillCall call{q.data_ptr<float>(), k.data_ptr<float>(), v.data_ptr<float>(),
                         out.data_ptr<float>(), q.stride(0), k.stride(0), v.stride(0),
                         KVH, H / KVH, D, static_cast<float>(scale), isa};
  int64_t work = 0;  // (query row x key) pairs
  for (const PrefillTask& t : tasks) work += work_of(t) * (H / KVH);
  // Below ~8K pairs (~0.5M multiply-adds at head size 64) waking the pool costs about as much.
  const int64_t threads =
      work < 8 * kParallelMinWork ? 1
                                  : std::min<int64_t>(at::get_num_threads(), tasks.size());
  std::atomic<int64_t> next{0};
  auto worker = [&](int64_t, int64_t) {
    thread_local PrefillScratch scratch;
    for (int64_t i = next++; i < int64_t(tasks.size()); i = next++)
      prefill_task(call, tasks[i], scratch);
  };
  if (threads == 1) worker(0, 1);
  else at::parallel_for(0, threads, 1, worker);
}

}  // namespace

TORCH_LIBRARY_IMPL(airserve, CPU, lib) {
  lib.impl("paged_decode_attention_cpu", &paged_decode_attention_cpu);
  lib.impl("prefill_attention_cpu", &prefill_attention_cpu);
  lib.impl("quantize_kv_cpu", &quantize_kv_cpu);
}

TORCH_LIBRARY_FRAGMENT(airserve_isa, lib) {
  lib.def("attention_isa() -> str", &attention_isa);
  lib.def("attention_isas() -> str[]", &attention_isas);
  lib.def("set_attention_isa(str name) -> str", &set_attention_isa);
}
