// What a conversion writes, decided before any weight is read: the GGUF metadata and, for every
// output tensor, which source rows it is made of and what is done to each element. Every
// transformation the Qwen architectures need (expert stacking, splitting fused projections,
// reordering heads, squeezing conv kernels) is a choice of rows; the rest is an element op.
#pragma once
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "common/gguf/gguf_value.h"
#include "tools/convert/safetensors.h"

namespace moraine::convert {

enum class ElemOp {
  None,
  NegExp,   // -exp(x): qwen3next stores A = -exp(A_log)
  PlusOne,  // x + 1: qwen3next RMSNorm weights are stored as offsets from one
};

// Rows [first_row, first_row + n_rows) of a source tensor's row view (see StTensor::row_len).
struct RowSpan {
  const StTensor* src = nullptr;
  int64_t first_row = 0;
  int64_t n_rows = 0;
};

struct PlannedTensor {
  std::string name;             // GGUF name, e.g. "blk.3.ffn_gate_exps.weight"
  std::vector<int64_t> shape;   // ggml order: shape[0] is the row length
  bool keep_f32 = false;        // norms, routers, conv kernels, 1-D tensors: never narrowed
  ElemOp op = ElemOp::None;
  std::vector<RowSpan> rows;    // concatenated in order; every source row has shape[0] elements

  int64_t n_rows() const;
};

struct ConvertPlan {
  std::string arch;  // general.architecture
  std::vector<std::pair<std::string, gguf::Value>> metadata;  // architecture keys, in write order
  std::vector<PlannedTensor> tensors;
};

}  // namespace moraine::convert
