#include "synthetic_model.h"

#include <algorithm>
#include <atomic>
#include <filesystem>
#include <random>
#include <stdexcept>
#include <unistd.h>

#include "common/formats/quant.h"

namespace moraine::testing {

namespace {
std::string blk(int64_t i, const std::string& s) { return "blk." + std::to_string(i) + "." + s; }
}  // namespace

std::string temp_path(const std::string& stem) {
  static std::atomic<int> counter{0};
  return (std::filesystem::temp_directory_path() /
          (stem + "-" + std::to_string(::getpid()) + "-" + std::to_string(counter++) + ".gguf"))
      .string();
}

SyntheticModel::SyntheticModel(SyntheticSpec s) : spec_(std::move(s)) {
  using gguf::Value;
  const std::string a = spec_.arch;
  const bool next = a == "qwen3next";
  meta.set("general.architecture", Value::string(a));
  meta.set(a + ".block_count", Value::u32(static_cast<uint32_t>(spec_.n_layer + spec_.n_nextn)));
  meta.set(a + ".embedding_length", Value::u32(static_cast<uint32_t>(spec_.n_embd)));
  meta.set(a + ".attention.head_count", Value::u32(static_cast<uint32_t>(spec_.n_head)));
  meta.set(a + ".attention.head_count_kv", Value::u32(static_cast<uint32_t>(spec_.n_head_kv)));
  meta.set(a + ".attention.key_length", Value::u32(static_cast<uint32_t>(spec_.head_dim)));
  meta.set(a + ".attention.value_length", Value::u32(static_cast<uint32_t>(spec_.head_dim)));
  meta.set(a + ".rope.dimension_count", Value::u32(static_cast<uint32_t>(spec_.n_rot)));
  meta.set(a + ".rope.freq_base", Value::f32(10000.0f));
  meta.set(a + ".attention.layer_norm_rms_epsilon", Value::f32(1e-6f));
  meta.set(a + ".expert_count", Value::u32(static_cast<uint32_t>(spec_.n_expert)));
  meta.set(a + ".expert_used_count", Value::u32(static_cast<uint32_t>(spec_.n_expert_used)));
  meta.set(a + ".expert_feed_forward_length", Value::u32(static_cast<uint32_t>(spec_.n_ff_exp)));
  if (next) {
    meta.set(a + ".expert_shared_feed_forward_length", Value::u32(static_cast<uint32_t>(spec_.n_ff_shexp)));
    meta.set(a + ".ssm.conv_kernel", Value::u32(static_cast<uint32_t>(spec_.ssm_conv_kernel)));
    meta.set(a + ".ssm.state_size", Value::u32(static_cast<uint32_t>(spec_.ssm_head_dim)));
    meta.set(a + ".ssm.group_count", Value::u32(static_cast<uint32_t>(spec_.ssm_k_heads)));
    meta.set(a + ".ssm.time_step_rank", Value::u32(static_cast<uint32_t>(spec_.ssm_v_heads)));
    meta.set(a + ".ssm.inner_size", Value::u32(static_cast<uint32_t>(spec_.ssm_head_dim * spec_.ssm_v_heads)));
    meta.set(a + ".full_attention_interval", Value::u32(static_cast<uint32_t>(spec_.full_attention_interval)));
    if (spec_.n_nextn > 0) meta.set(a + ".nextn_predict_layers", Value::u32(static_cast<uint32_t>(spec_.n_nextn)));
  }

  const int64_t E = spec_.n_embd, V = spec_.n_vocab, hd = spec_.head_dim;
  const int64_t q_dim = spec_.n_head * hd, kv_dim = spec_.n_head_kv * hd;
  tensors.push_back({"token_embd.weight", {E, V}});
  tensors.push_back({"output_norm.weight", {E}});
  tensors.push_back({"output.weight", {E, V}});
  const int64_t key_dim = spec_.ssm_head_dim * spec_.ssm_k_heads;
  const int64_t v_dim = spec_.ssm_head_dim * spec_.ssm_v_heads;
  for (int64_t il = 0; il < spec_.n_layer + spec_.n_nextn; ++il) {
    const bool mtp = il >= spec_.n_layer;
    const bool recurrent = next && !mtp && (il + 1) % spec_.full_attention_interval != 0;
    tensors.push_back({blk(il, "attn_norm.weight"), {E}});
    if (recurrent) {
      if (spec_.legacy_ssm_in) {
        tensors.push_back({blk(il, "ssm_in.weight"), {E, 2 * key_dim + 2 * v_dim}});
      } else {
        tensors.push_back({blk(il, "attn_qkv.weight"), {E, 2 * key_dim + v_dim}});
        tensors.push_back({blk(il, "attn_gate.weight"), {E, v_dim}});
      }
      tensors.push_back({blk(il, "ssm_ba.weight"), {E, 2 * spec_.ssm_v_heads}});
      tensors.push_back({blk(il, "ssm_conv1d.weight"), {spec_.ssm_conv_kernel, 2 * key_dim + v_dim}});
      tensors.push_back({blk(il, "ssm_dt.bias"), {spec_.ssm_v_heads}});
      tensors.push_back({blk(il, "ssm_a"), {spec_.ssm_v_heads}});
      tensors.push_back({blk(il, "ssm_norm.weight"), {spec_.ssm_head_dim}});
      tensors.push_back({blk(il, "ssm_out.weight"), {v_dim, E}});
    } else {
      tensors.push_back({blk(il, "attn_q.weight"), {E, next ? 2 * q_dim : q_dim}});
      tensors.push_back({blk(il, "attn_k.weight"), {E, kv_dim}});
      tensors.push_back({blk(il, "attn_v.weight"), {E, kv_dim}});
      tensors.push_back({blk(il, "attn_output.weight"), {q_dim, E}});
      tensors.push_back({blk(il, "attn_q_norm.weight"), {hd}});
      tensors.push_back({blk(il, "attn_k_norm.weight"), {hd}});
    }
    tensors.push_back({blk(il, next ? "post_attention_norm.weight" : "ffn_norm.weight"), {E}});
    tensors.push_back({blk(il, "ffn_gate_inp.weight"), {E, spec_.n_expert}});
    tensors.push_back({blk(il, "ffn_gate_exps.weight"), {E, spec_.n_ff_exp, spec_.n_expert}});
    tensors.push_back({blk(il, "ffn_up_exps.weight"), {E, spec_.n_ff_exp, spec_.n_expert}});
    tensors.push_back({blk(il, "ffn_down_exps.weight"), {spec_.n_ff_exp, E, spec_.n_expert}});
    if (next) {
      tensors.push_back({blk(il, "ffn_gate_inp_shexp.weight"), {E}});
      tensors.push_back({blk(il, "ffn_gate_shexp.weight"), {E, spec_.n_ff_shexp}});
      tensors.push_back({blk(il, "ffn_up_shexp.weight"), {E, spec_.n_ff_shexp}});
      tensors.push_back({blk(il, "ffn_down_shexp.weight"), {spec_.n_ff_shexp, E}});
    }
    if (mtp) {
      tensors.push_back({blk(il, "nextn.eh_proj.weight"), {2 * E, E}});
      tensors.push_back({blk(il, "nextn.enorm.weight"), {E}});
      tensors.push_back({blk(il, "nextn.hnorm.weight"), {E}});
      tensors.push_back({blk(il, "nextn.shared_head_norm.weight"), {E}});
    }
  }
}

void SyntheticModel::drop(const std::string& name) {
  auto it = std::find_if(tensors.begin(), tensors.end(), [&](auto& t) { return t.first == name; });
  if (it == tensors.end()) throw std::invalid_argument("no tensor " + name);
  tensors.erase(it);
}

void SyntheticModel::reshape(const std::string& name, std::vector<int64_t> shape) {
  auto it = std::find_if(tensors.begin(), tensors.end(), [&](auto& t) { return t.first == name; });
  if (it == tensors.end()) throw std::invalid_argument("no tensor " + name);
  it->second = std::move(shape);
}

void SyntheticModel::add(const std::string& name, std::vector<int64_t> shape) {
  tensors.push_back({name, std::move(shape)});
}

void SyntheticModel::write(const std::string& path) {
  std::mt19937_64 rng(spec_.seed);
  std::vector<std::vector<uint8_t>> keep;  // data must outlive GgufWriter::write
  gguf::GgufWriter w = meta;
  for (const auto& [name, shape] : tensors) {
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    std::vector<float> x(static_cast<size_t>(n));
    const bool is_vector = shape.size() == 1;
    auto uni = [&](float lo, float hi) {
      return lo + (hi - lo) * static_cast<float>(static_cast<double>(rng() >> 11) * 0x1.0p-53);
    };
    if (name.ends_with("ssm_a")) {
      for (float& v : x) v = -std::exp(uni(-1.0f, 1.0f));  // -exp(A_log): a decay rate
    } else if (name.ends_with("ssm_dt.bias")) {
      for (float& v : x) v = uni(-1.0f, 1.0f);
    } else if (is_vector) {
      for (float& v : x) v = uni(0.5f, 1.5f);  // norm weights around one
    } else if (name.find("ssm_conv1d") != std::string::npos) {
      for (float& v : x) v = uni(-0.6f, 0.6f);
    } else {
      const float r = 1.7f / std::sqrt(static_cast<float>(shape[0]));  // unit-variance outputs
      for (float& v : x) v = uni(-r, r);
    }
    TensorType t = TensorType::F32;
    if (!is_vector && name.find("ssm_conv1d") == std::string::npos &&
        shape[0] % type_traits(spec_.matrix_type).block_elems == 0) {
      t = spec_.matrix_type;
    }
    std::vector<uint8_t> bytes(row_bytes(t, shape[0]) * static_cast<size_t>(n / shape[0]));
    for (int64_t r = 0; r < n / shape[0]; ++r) {
      quantize_row(t, x.data() + r * shape[0], bytes.data() + r * row_bytes(t, shape[0]), shape[0]);
    }
    keep.push_back(std::move(bytes));
    w.add_tensor(name, shape, t, keep.back().data(), keep.back().size());
  }
  w.write(path);
}

}  // namespace moraine::testing
