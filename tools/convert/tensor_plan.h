// What a conversion writes, decided before any weight is read: the GGUF metadata and, for every
// output tensor, which source rows it is made of and what is done to each element. Expert
// stacking, splitting fused projections, reordering heads and squeezing conv kernels are a choice
// of rows; transposes and de-interleaves (gpt-oss's fused experts) are strided rows; the rest is
// an element op. Tensors the checkpoint already holds in a GGUF block format (MXFP4) are copied
// as bytes by a fill function instead.
#pragma once
#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "common/formats/tensor_type.h"
#include "common/gguf/gguf_value.h"
#include "tools/convert/safetensors.h"

namespace moraine::convert {

enum class ElemOp {
  None,
  NegExp,   // -exp(x): qwen3next stores A = -exp(A_log)
  PlusOne,  // x + 1: qwen3next RMSNorm weights are stored as offsets from one
};

// Rows [first_row, first_row + n_rows) of a source tensor's row view (see StTensor::row_len).
// With elem_stride > 0 the rows are gathered across the source's flat elements instead: element
// i of row k is source element first_row + k * row_stride + i * elem_stride.
struct RowSpan {
  const StTensor* src = nullptr;
  int64_t first_row = 0;
  int64_t n_rows = 0;
  int64_t elem_stride = 0;
  int64_t row_stride = 0;
};

struct PlannedTensor {
  std::string name;             // GGUF name, e.g. "blk.3.ffn_gate_exps.weight"
  std::vector<int64_t> shape;   // ggml order: shape[0] is the row length
  bool keep_f32 = false;        // norms, routers, conv kernels, 1-D tensors: never narrowed
  ElemOp op = ElemOp::None;
  std::vector<RowSpan> rows;    // concatenated in order; every source row has shape[0] elements
  std::vector<int64_t> col_perm;  // empty, or: element i of each row is element col_perm[i] of its source row
  // Set for a tensor copied in its block format: raw_type is written whatever the output type,
  // and raw_fill writes all n_rows() * row_bytes(raw_type, shape[0]) bytes (rows stays empty).
  TensorType raw_type = TensorType::F32;
  std::function<void(uint8_t* dst)> raw_fill;

  int64_t n_rows() const;
};

struct ConvertPlan {
  std::string arch;  // general.architecture
  std::vector<std::pair<std::string, gguf::Value>> metadata;  // architecture keys, in write order
  std::vector<PlannedTensor> tensors;
  std::vector<std::string> notes;  // what the conversion could not carry over exactly
};

}  // namespace moraine::convert
