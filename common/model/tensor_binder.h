// Binds GGUF tensors by name with shape checks: every tensor a recipe asks for must exist with
// exactly the shape the hyper-parameters imply, and every tensor in the file must be asked for,
// so metadata that disagrees with the tensors is refused at load with both shapes named.
#pragma once
#include <cstdint>
#include <set>
#include <string>
#include <vector>

#include "common/formats/tensor_type.h"

namespace moraine::gguf {
class GgufFile;
struct TensorInfo;
}  // namespace moraine::gguf

namespace moraine::model {

// A weight matrix in ggml order: n_rows rows of n_cols contiguous elements of one type.
// For a 3-D expert tensor {n_cols, n_rows, n_expert}, expert(e) is expert e's matrix.
struct Matrix {
  const gguf::TensorInfo* info = nullptr;
  TensorType type = TensorType::F32;
  int64_t n_cols = 0;
  int64_t n_rows = 0;
  size_t row_bytes = 0;
  const uint8_t* data = nullptr;

  explicit operator bool() const { return info != nullptr; }
  const uint8_t* row(int64_t r) const { return data + static_cast<size_t>(r) * row_bytes; }
};

struct ExpertTensor {
  Matrix all;          // n_rows counts every expert's rows together
  int64_t n_expert = 0;
  int64_t rows_per_expert = 0;

  explicit operator bool() const { return static_cast<bool>(all); }
  Matrix expert(int64_t e) const {
    Matrix m = all;
    m.n_rows = rows_per_expert;
    m.data = all.data + static_cast<size_t>(e * rows_per_expert) * all.row_bytes;
    return m;
  }
};

std::string shape_string(const std::vector<int64_t>& shape);  // "[2048, 151936]"

class TensorBinder {
 public:
  explicit TensorBinder(const gguf::GgufFile& file);

  Matrix matrix(const std::string& name, int64_t n_cols, int64_t n_rows);
  ExpertTensor experts(const std::string& name, int64_t n_cols, int64_t n_rows, int64_t n_expert);
  std::vector<float> vector(const std::string& name, int64_t n);  // dequantized to float
  // A small tensor of any rank (per-expert biases), dequantized row by row, ggml order.
  std::vector<float> floats(const std::string& name, const std::vector<int64_t>& shape);

  bool has(const std::string& name) const;

  // Throws if any tensor of the file was never bound (llama.cpp refuses such files too: an
  // extra blk.N.* usually means block_count or expert_count disagrees with the tensors).
  void check_all_bound() const;

 private:
  const gguf::TensorInfo& find(const std::string& name, const std::vector<int64_t>& shape);
  const gguf::GgufFile& file_;
  std::string where_;
  std::set<std::string> bound_;
};

inline std::string blk(int64_t layer, const char* suffix) {
  return "blk." + std::to_string(layer) + "." + suffix;
}

}  // namespace moraine::model
