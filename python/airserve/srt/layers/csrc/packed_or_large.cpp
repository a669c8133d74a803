// packed_or_large: a linear layer's product that picks its path by x's row count when it runs,
// so one graph compiled for a symbolic batch size serves batches on both sides of the packed
// limit (quant/packed_or_large.py). Rows 1..max_rows: the packed block product (the operator
// Linear.forward calls for that many rows); more rows: the layer's large path. Both call the
// same operators the layer calls eagerly, through the dispatcher, so the results are the same.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <string>
#include <vector>

namespace {

using OptTensor = c10::optional<at::Tensor>;
using BlockFn = at::Tensor(const at::Tensor&, const std::string&, const at::Tensor&,
                           const OptTensor&, const OptTensor&);
using HandleFn = at::Tensor(const at::Tensor&, int64_t);

c10::TypedOperatorHandle<BlockFn> block_op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<BlockFn>();
}

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
  if (kind == "q4_1") return q4_1_op.call(x, qs, *d, *m);
  if (kind == "q8_0") return q8_0_op.call(x, qs, *d);
  return f32_op.call(x, kind, qs, d, m);
}

at::Tensor large(const at::Tensor& x, const std::string& path, int64_t handle,
                 const OptTensor& weight) {
  if (path == "onednn" || path == "int8" || path == "bf16") {
    const char* name = path == "onednn" ? "airserve::onednn_linear"
                       : path == "int8" ? "airserve::w8a8_linear"
                                        : "airserve::bf16_linear";
    const auto op = c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<HandleFn>();
    return op.call(x, handle).to(x.scalar_type());
  }
  TORCH_CHECK(weight.has_value(), "airserve::packed_or_large: path '", path,
              "' needs the weight");
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

// One block segment (the common case): no lists to convert on the call.
at::Tensor packed_or_large_1(const at::Tensor& x, int64_t max_rows, const std::string& kind,
                             const std::string& activations, const at::Tensor& qs,
                             const OptTensor& d, const OptTensor& m, const std::string& path,
                             int64_t handle, const OptTensor& weight) {
  const int64_t rows = x.size(0);
  if (rows <= 0 || rows > max_rows) return large(x, path, handle, weight);
  return packed(x, kind, activations, qs, d, m);
}

}  // namespace

TORCH_LIBRARY_IMPL(airserve, CPU, lib) {
  lib.impl("packed_or_large", &packed_or_large);
  lib.impl("packed_or_large_1", &packed_or_large_1);
}
