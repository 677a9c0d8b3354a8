// Tiny random qwen3moe / qwen3next GGUF files for tests that must not wait for converted
// checkpoints: loader refusals (a tensor dropped or reshaped, metadata changed) and executor
// self-consistency (decode after prefill, thread counts, quantized weights).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "common/formats/tensor_type.h"
#include "common/gguf/gguf.h"

namespace moraine::testing {

struct SyntheticSpec {
  std::string arch = "qwen3moe";   // or "qwen3next"
  int64_t n_layer = 2;
  int64_t n_embd = 64;
  int64_t n_vocab = 97;
  int64_t n_head = 4, n_head_kv = 2, head_dim = 16;
  int64_t n_rot = 16;              // qwen3next: partial rotary (e.g. 4)
  int64_t n_expert = 6, n_expert_used = 2, n_ff_exp = 32, n_ff_shexp = 48;
  int64_t ssm_conv_kernel = 4, ssm_head_dim = 16, ssm_k_heads = 2, ssm_v_heads = 4;
  int64_t full_attention_interval = 2;
  int64_t n_nextn = 0;
  bool legacy_ssm_in = false;      // qwen3next: fused ssm_in instead of attn_qkv + attn_gate
  TensorType matrix_type = TensorType::F32;  // type of the 2-D/3-D weights
  uint64_t seed = 1;
};

// The metadata and tensor list of a model of `spec`; tests edit either (drop, reshape, add a
// tensor; set or remove a key) before write() fills the tensors with seeded random values.
class SyntheticModel {
 public:
  explicit SyntheticModel(SyntheticSpec spec);

  std::vector<std::pair<std::string, std::vector<int64_t>>> tensors;
  gguf::GgufWriter meta;  // metadata only; write() adds the tensors

  void drop(const std::string& name);
  void reshape(const std::string& name, std::vector<int64_t> shape);
  void add(const std::string& name, std::vector<int64_t> shape);
  void write(const std::string& path);  // random data, seeded by spec.seed

  const SyntheticSpec& spec() const { return spec_; }

 private:
  SyntheticSpec spec_;
};

std::string temp_path(const std::string& stem);  // unique file under the system temp dir

}  // namespace moraine::testing
