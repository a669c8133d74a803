// packed_or_large: a linear layer's product that picks its path by x's row count when it runs,
// so one graph compiled for a symbolic batch size serves batches on both sides of the packed
// limit (quant/packed_or_large.py). Rows 1..max_rows: the packed block product (the operator
// Linear.forward calls for that many rows); more rows: the layer's large path. Both call the
// same operators the layer calls eagerly, through the dispatcher, so the results are the same.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/native/quantized/PackedParams.h>
#include <torch/library.h>

#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "cpu_common.h"

namespace {

using OptTensor = c10::optional<at::Tensor>;
using BlockFn = at::Tensor(const at::Tensor&, const std::string&, const at::Tensor&,
                           const OptTensor&, const OptTensor&);
using HandleFn = at::Tensor(const at::Tensor&, int64_t);

c10::TypedOperatorHandle<BlockFn> block_op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<BlockFn>();
}

// Rows the int16 products take at most: larger decode batches multiply in float32, as
// block_matvec.INT16_MAX_ROWS says (and why); test_block_int16.py compares the two.
constexpr int64_t kInt16MaxRows = 2;

at::Tensor packed(const at::Tensor& x, const std::string& kind, const std::string& activations,
                  const at::Tensor& qs, const OptTensor& d, const OptTensor& m) {
  static const auto int8_op = block_op("airserve::block_matmul_int8");
  static const auto f32_op = block_op("airserve::block_matmul_f32");
  static const auto q4_1_op = c10::Dispatcher::singleton()
      .findSchemaOrThrow("airserve::q4_1_matmul", "")
      .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                        const at::Tensor&)>();
  static const auto q8_0_op = c10::Dispatcher::singleton()
      .findSchemaOrThrow("airserve::q8_0_matmul", "")
      .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&)>();
  if (activations == "int8") return int8_op.call(x, kind, qs, d, m);
  if (activations == "int16" && x.size(0) <= kInt16MaxRows) {
    static const auto i16_op = c10::Dispatcher::singleton()
        .findSchemaOrThrow("airserve::q4_1_matmul_i16", "")
        .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                          const at::Tensor&)>();
    static const auto i16_k_op = c10::Dispatcher::singleton()
        .findSchemaOrThrow("airserve::block_matmul_i16", "")
        .typed<at::Tensor(const at::Tensor&, const std::string&, const at::Tensor&)>();
    static const auto i16_q8_0_op = c10::Dispatcher::singleton()
        .findSchemaOrThrow("airserve::q8_0_matmul_i16", "")
        .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&)>();
    if (kind == "q4_1") return i16_op.call(x, qs, *d, *m);
    if (kind == "q8_0") return i16_q8_0_op.call(x, qs, *d);
    TORCH_CHECK(kind == "q4_k" || kind == "q6_k", "airserve::packed_or_large: int16 activations "
                "are for q4_1, q8_0, q4_k and q6_k blocks, not ", kind);
    return i16_k_op.call(x, kind, qs);
  }
  if (kind == "q4_1") return q4_1_op.call(x, qs, *d, *m);
  if (kind == "q8_0") return q8_0_op.call(x, qs, *d);
  return f32_op.call(x, kind, qs, d, m);
}

// ---- The bfloat16 path's product, without a trip through Python ----
//
// quant/matmul_paths.py registers each bf16 weight here as it packs it (and releases it when
// its Bf16Weight goes), so that this operator, and the large side of packed_or_large, multiply
// in C++: its Python operator cost ~tens of microseconds a call, ~120 calls a decode step.
struct Bf16Weight {
  at::Tensor packed;  // bf16 [N, K]: oneDNN's opaque blocked tensor when `onednn`
  bool onednn;
  OptTensor channels;  // int64 [k]: input channels whose bf16 rounding error is added back
  OptTensor residual;  // float32 [k, N]: the weight's columns there
};

// Weights registered from Python by handle (the handle a compiled graph holds), one store per
// weight form; lookups copy the entry out under the lock.
template <typename W>
class WeightStore {
 public:
  explicit WeightStore(const char* what) : what_(what) {}
  void put(int64_t handle, W weight) {
    std::lock_guard<std::mutex> lock(mutex_);
    weights_[handle] = std::move(weight);
  }
  void erase(int64_t handle) {
    std::lock_guard<std::mutex> lock(mutex_);
    weights_.erase(handle);
  }
  W get(int64_t handle, const char* op) {
    std::lock_guard<std::mutex> lock(mutex_);
    const auto it = weights_.find(handle);
    TORCH_CHECK(it != weights_.end(), op, ": no ", what_, " weight ", handle,
                " (released, or packed before the C++ kernels loaded)");
    return it->second;
  }

 private:
  const char* what_;
  std::mutex mutex_;
  std::unordered_map<int64_t, W> weights_;
};

WeightStore<Bf16Weight>& bf16_weights() {
  static WeightStore<Bf16Weight> store("bf16");
  return store;
}

void bf16_weight_register(int64_t handle, const at::Tensor& packed, bool onednn,
                          const OptTensor& channels, const OptTensor& residual) {
  bf16_weights().put(handle, Bf16Weight{packed, onednn, channels, residual});
}

void bf16_weight_release(int64_t handle) { bf16_weights().erase(handle); }

Bf16Weight bf16_weight(int64_t handle) {
  return bf16_weights().get(handle, "airserve::bf16_linear_cpp");
}

using LinearPointwiseFn = at::Tensor(const at::Tensor&, const at::Tensor&, const OptTensor&,
                                     c10::string_view, c10::List<std::optional<at::Scalar>>,
                                     std::optional<c10::string_view>);

// bf16 [M, K] times the weight: oneDNN's (or torch's) bf16 product, bf16 [M, N].
at::Tensor bf16_product(const at::Tensor& xb, const Bf16Weight& w) {
  if (!w.onednn) return at::linear(xb, w.packed);
  static const auto op = c10::Dispatcher::singleton()
      .findSchemaOrThrow("mkldnn::_linear_pointwise", "")
      .typed<LinearPointwiseFn>();
  return op.call(xb, w.packed, c10::nullopt, "none", c10::List<std::optional<at::Scalar>>(),
                 c10::string_view(""));
}

// x float32 [M, K] -> float32 [M, N]; keep_bf16: oneDNN's bf16 product as written, unless the
// weight adds float32 residual channels. The same operations as matmul_paths._bf16_product.
at::Tensor bf16_linear_cpp(const at::Tensor& x, int64_t handle, bool keep_bf16) {
  const Bf16Weight w = bf16_weight(handle);
  const at::Tensor xb = x.scalar_type() == at::kFloat ? airserve_cpu::cast_to_bf16(x)
                                                      : x.to(at::kBFloat16);
  at::Tensor out = bf16_product(xb, w);
  if (!w.channels.has_value()) return keep_bf16 ? out : airserve_cpu::widen_to_f32(out);
  out = airserve_cpu::widen_to_f32(out);
  if (x.scalar_type() == at::kFloat)
    return out.addmm_(airserve_cpu::bf16_rounding_error(x, *w.channels), *w.residual);
  const at::Tensor xs = x.index_select(1, *w.channels).to(at::kFloat);
  return out.addmm_(xs - xs.to(at::kBFloat16).to(at::kFloat), *w.residual);
}

// The same product for activations that arrive as bf16 already: xb bf16 [M, K], the rounding
// of float32 activations x, and err float32 [M, k], x less that rounding at the weight's
// residual channels (silu_and_mul_bf16 makes both): float32 [M, N], bf16_linear_cpp(x)'s bits.
at::Tensor bf16_linear_from_bf16(const at::Tensor& xb, const at::Tensor& err, int64_t handle) {
  const char* name = "airserve::bf16_linear_from_bf16";
  const Bf16Weight w = bf16_weight(handle);
  TORCH_CHECK(xb.dim() == 2 && xb.scalar_type() == at::kBFloat16, name,
              ": xb must be bfloat16 [rows, in_features], got ", xb.scalar_type(), " ",
              xb.sizes());
  const int64_t k = w.channels.has_value() ? w.channels->numel() : 0;
  TORCH_CHECK(err.dim() == 2 && err.size(0) == xb.size(0) && err.size(1) == k &&
                  err.scalar_type() == at::kFloat,
              name, ": err must be float32 [", xb.size(0), ", ", k,
              "] (the weight's residual channels), got ", err.scalar_type(), " ", err.sizes());
  at::Tensor out = airserve_cpu::widen_to_f32(bf16_product(xb.contiguous(), w));
  if (k == 0) return out;
  return out.addmm_(err.contiguous(), *w.residual);
}

// ---- float16_weights' product, without a trip through Python ----
//
// quant/matmul_paths.py registers each fbgemm-packed float16 weight here as it packs it (and
// releases it when its Fp16Weight goes); the product is fbgemm's, called on the packed object.
using PackedLinear = c10::intrusive_ptr<LinearPackedParamsBase>;

WeightStore<PackedLinear>& fp16_weights() {
  static WeightStore<PackedLinear> store("float16");
  return store;
}

void fp16_weight_register(int64_t handle, const PackedLinear& packed) {
  fp16_weights().put(handle, packed);
}

void fp16_weight_release(int64_t handle) { fp16_weights().erase(handle); }

// x float32 [M, K] -> float32 [M, N]: fbgemm's float32 product over the float16 weight.
at::Tensor fp16_weight_linear_cpp(const at::Tensor& x, int64_t handle) {
  const PackedLinear packed = fp16_weights().get(handle, "airserve::fp16_weight_linear_cpp");
  TORCH_CHECK(x.scalar_type() == at::kFloat, "airserve::fp16_weight_linear_cpp: x must be "
              "float32, got ", x.scalar_type());
  return packed->apply_dynamic(x.contiguous(), /*reduce_range=*/false);
}

at::Tensor large(const at::Tensor& x, const std::string& path, int64_t handle,
                 const OptTensor& weight) {
  if (path == "bf16") return bf16_linear_cpp(x, handle, false).to(x.scalar_type());
  if (path == "onednn" || path == "int8" || path == "fp16") {
    // Through the dispatcher (a profiler sees them as they run eagerly).
    const char* name = path == "onednn" ? "airserve::onednn_linear"
                       : path == "int8" ? "airserve::w8a8_linear"
                                        : "airserve::fp16_weight_linear_cpp";
    const auto op = c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<HandleFn>();
    return op.call(x, handle).to(x.scalar_type());
  }
  TORCH_CHECK(weight.has_value(), "airserve::packed_or_large: path '", path,
              "' needs the weight");
  if (path == "int8_blocks") {  // the weight from pack_int8_blocks (block_int8_gemm.cpp)
    static const auto op = c10::Dispatcher::singleton()
        .findSchemaOrThrow("airserve::gemm_int8_blocks", "")
        .typed<at::Tensor(const at::Tensor&, const at::Tensor&)>();
    return op.call(x, *weight);
  }
  TORCH_CHECK(path == "sgemm", "airserve::packed_or_large: unknown large path '", path, "'");
  return at::linear(x, *weight);
}

std::vector<std::string> split(const std::string& joined) {
  std::vector<std::string> parts;
  size_t start = 0;
  for (size_t comma; (comma = joined.find(',', start)) != std::string::npos; start = comma + 1)
    parts.push_back(joined.substr(start, comma - start));
  parts.push_back(joined.substr(start));
  return parts;
}

// kinds and activations: one per block segment (output rows in order), joined by ",".
at::Tensor packed_or_large(const at::Tensor& x, int64_t max_rows, const std::string& kinds,
                           const std::string& activations, at::TensorList qs,
                           const c10::List<c10::optional<at::Tensor>>& d,
                           const c10::List<c10::optional<at::Tensor>>& m,
                           const std::string& path, int64_t handle, const OptTensor& weight) {
  const int64_t rows = x.size(0);
  if (rows <= 0 || rows > max_rows) return large(x, path, handle, weight);
  const std::vector<std::string> kind = split(kinds), act = split(activations);
  const size_t n = qs.size();
  TORCH_CHECK(kind.size() == n && act.size() == n && d.size() == n && m.size() == n,
              "airserve::packed_or_large: one kind, activation, qs, d and m per segment");
  if (n == 1) return packed(x, kind[0], act[0], qs[0], d.get(0), m.get(0));
  std::vector<at::Tensor> outs;
  for (size_t i = 0; i < n; ++i)
    outs.push_back(packed(x, kind[i], act[i], qs[i], d.get(i), m.get(i)));
  return at::cat(outs, -1);
}

// packed_or_large_1's names by code: the tables of quant/packed_or_large.py (KINDS,
// ACTIVATIONS, LARGE_PATHS), in their order; test_packed_or_large.py compares them.
const std::vector<std::string>& code_names(const std::string& field) {
  static const std::vector<std::string> kinds{"q4_1", "q8_0", "q5_0", "q5_1",
                                              "q4_k", "q5_k", "q6_k"};
  static const std::vector<std::string> activations{"float32", "int8", "int16"};
  static const std::vector<std::string> paths{"sgemm", "onednn", "bf16", "int8", "fp16",
                                              "int8_blocks"};
  static const std::vector<std::string> int16_rows{std::to_string(kInt16MaxRows)};
  if (field == "kind") return kinds;
  if (field == "int16_max_rows") return int16_rows;
  if (field == "activations") return activations;
  TORCH_CHECK(field == "path", "airserve_codes::packed_or_large_names: unknown field '", field,
              "' (kind, activations, path or int16_max_rows)");
  return paths;
}

std::vector<std::string> packed_or_large_names(const std::string& field) {
  return code_names(field);
}

const std::string& name_of(const std::vector<std::string>& table, int64_t code,
                           const char* field) {
  TORCH_CHECK(code >= 0 && code < static_cast<int64_t>(table.size()),
              "airserve::packed_or_large_1: ", field, " code ", code, " is not one of 0..",
              table.size() - 1);
  return table[code];
}

// One block segment (the common case): no lists or strings to convert on the call.
at::Tensor packed_or_large_1(const at::Tensor& x, int64_t max_rows, int64_t kind,
                             int64_t activations, const at::Tensor& qs, const OptTensor& d,
                             const OptTensor& m, int64_t path, int64_t handle,
                             const OptTensor& weight) {
  static const std::vector<std::string>& kinds = code_names("kind");
  static const std::vector<std::string>& acts = code_names("activations");
  static const std::vector<std::string>& paths = code_names("path");
  const int64_t rows = x.size(0);
  if (rows <= 0 || rows > max_rows) return large(x, name_of(paths, path, "path"), handle, weight);
  return packed(x, name_of(kinds, kind, "kind"), name_of(acts, activations, "activations"), qs,
                d, m);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(airserve_bf16, lib) {
  lib.def("register_weight(int handle, Tensor packed, bool onednn, Tensor? channels, "
          "Tensor? residual) -> ()", &bf16_weight_register);
  lib.def("release_weight(int handle) -> ()", &bf16_weight_release);
}

TORCH_LIBRARY_FRAGMENT(airserve_codes, lib) {
  lib.def("packed_or_large_names(str field) -> str[]", &packed_or_large_names);
}

TORCH_LIBRARY_FRAGMENT(airserve_fp16, lib) {
  lib.def("register_weight(int handle, __torch__.torch.classes.quantized.LinearPackedParamsBase "
          "packed) -> ()", &fp16_weight_register);
  lib.def("release_weight(int handle) -> ()", &fp16_weight_release);
}

namespace {
// The conversions bf16_linear_cpp uses, as operators (tests compare them with torch's).
at::Tensor cast_to_bf16_op(const at::Tensor& x) { return airserve_cpu::cast_to_bf16(x); }
at::Tensor widen_to_f32_op(const at::Tensor& x) { return airserve_cpu::widen_to_f32(x); }
}  // namespace

TORCH_LIBRARY_IMPL(airserve, CPU, lib) {
  lib.impl("bf16_linear_cpp", &bf16_linear_cpp);
  lib.impl("fp16_weight_linear_cpp", &fp16_weight_linear_cpp);
  lib.impl("bf16_linear_from_bf16", &bf16_linear_from_bf16);
  lib.impl("cast_to_bf16", &cast_to_bf16_op);
  lib.impl("widen_to_f32", &widen_to_f32_op);
  lib.impl("packed_or_large", &packed_or_large);
  lib.impl("packed_or_large_1", &packed_or_large_1);
}
