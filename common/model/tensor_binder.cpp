#include "common/model/tensor_binder.h"

#include <algorithm>

#include "common/formats/quant.h"
#include "common/gguf/gguf.h"
#include "common/model/model_error.h"

namespace moraine::model {

std::string shape_string(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) {
    if (i) s += ", ";
    s += std::to_string(shape[i]);
  }
  return s + "]";
}

TensorBinder::TensorBinder(const gguf::GgufFile& file)
    : file_(file), where_(file.paths().empty() ? std::string("model") : file.paths()[0]) {}

bool TensorBinder::has(const std::string& name) const { return file_.find_tensor(name) != nullptr; }

namespace {
// ggml tensors always have four dimensions, so a file may spell [n] as [n, 1] (llama.cpp's own
// converter writes the qwen3next shared-expert gate, a 1 x n_embd matrix, that way).
bool same_shape(const std::vector<int64_t>& a, const std::vector<int64_t>& b) {
  const size_t n = std::max(a.size(), b.size());
  for (size_t i = 0; i < n; ++i) {
    if ((i < a.size() ? a[i] : 1) != (i < b.size() ? b[i] : 1)) return false;
  }
  return true;
}
}  // namespace

const gguf::TensorInfo& TensorBinder::find(const std::string& name,
                                           const std::vector<int64_t>& shape) {
  const gguf::TensorInfo* t = file_.find_tensor(name);
  if (t == nullptr) {
    throw ModelError(where_ + ": tensor " + name + " is missing (expected shape " +
                     shape_string(shape) + ")");
  }
  if (!same_shape(t->shape, shape)) {
    throw ModelError(where_ + ": tensor " + name + " has shape " + shape_string(t->shape) +
                     ", the metadata implies " + shape_string(shape));
  }
  const TypeTraits& tr = type_traits(t->type);
  if (!tr.computable) {
    throw ModelError(where_ + ": tensor " + name + " has type " + std::string(tr.name) +
                     ", which moraine cannot compute with");
  }
  if (shape[0] % tr.block_elems != 0) {
    throw ModelError(where_ + ": tensor " + name + " row length " + std::to_string(shape[0]) +
                     " is not a multiple of the " + std::string(tr.name) + " block size " +
                     std::to_string(tr.block_elems));
  }
  if (t->data == nullptr) throw ModelError(where_ + ": tensor " + name + " has no data mapped");
  bound_.insert(name);
  return *t;
}

Matrix TensorBinder::matrix(const std::string& name, int64_t n_cols, int64_t n_rows) {
  const gguf::TensorInfo& t = find(name, {n_cols, n_rows});
  return Matrix{&t, t.type, n_cols, n_rows, row_bytes(t.type, n_cols), t.data};
}

ExpertTensor TensorBinder::experts(const std::string& name, int64_t n_cols, int64_t n_rows,
                                   int64_t n_expert) {
  const gguf::TensorInfo& t = find(name, {n_cols, n_rows, n_expert});
  ExpertTensor e;
  e.all = Matrix{&t, t.type, n_cols, n_rows * n_expert, row_bytes(t.type, n_cols), t.data};
  e.n_expert = n_expert;
  e.rows_per_expert = n_rows;
  return e;
}

std::vector<float> TensorBinder::vector(const std::string& name, int64_t n) {
  const gguf::TensorInfo& t = find(name, {n});
  std::vector<float> v(static_cast<size_t>(n));
  dequantize_row(t.type, t.data, v.data(), n);
  return v;
}

std::vector<float> TensorBinder::floats(const std::string& name, const std::vector<int64_t>& shape) {
  const gguf::TensorInfo& t = find(name, shape);
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  std::vector<float> v(static_cast<size_t>(n));
  const size_t rb = row_bytes(t.type, shape[0]);
  for (int64_t r = 0; r < n / shape[0]; ++r) dequantize_row(t.type, t.data + r * rb, v.data() + r * shape[0], shape[0]);
  return v;
}

void TensorBinder::check_all_bound() const {
  std::string extra;
  int n_extra = 0;
  for (const gguf::TensorInfo& t : file_.tensors()) {
    if (bound_.count(t.name)) continue;
    if (n_extra < 4) extra += (n_extra ? ", " : "") + t.name + " " + shape_string(t.shape);
    ++n_extra;
  }
  if (n_extra > 0) {
    throw ModelError(where_ + ": " + std::to_string(n_extra) +
                     " tensor(s) the metadata does not account for: " + extra +
                     (n_extra > 4 ? ", ..." : "") +
                     " (does block_count / expert_count / nextn_predict_layers match the file?)");
  }
}

}  // namespace moraine::model
