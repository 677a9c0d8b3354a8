#include "tools/convert/convert.h"

#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "common/formats/quant.h"
#include "common/gguf/gguf.h"
#include "tools/convert/hf_tokenizer.h"
#include "tools/convert/arch_converter.h"
#include "tools/convert/safetensors.h"

namespace moraine::convert {

namespace fs = std::filesystem;
using gguf::Value;

namespace {

// llama.cpp's general.file_type numbers (LlamaFileType) for the output types we write.
uint32_t file_type_id(TensorType t) {
  switch (t) {
    case TensorType::F32: return 0;
    case TensorType::F16: return 1;
    case TensorType::Q8_0: return 7;
    case TensorType::BF16: return 32;
    default: throw ConvertError("output type " + std::string(type_name(t)) + " is not one of f32, f16, bf16, q8_0");
  }
}

void apply(ElemOp op, float* x, int64_t n) {
  switch (op) {
    case ElemOp::None: return;
    case ElemOp::NegExp:
      for (int64_t i = 0; i < n; ++i) x[i] = -std::exp(x[i]);
      return;
    case ElemOp::PlusOne:
      for (int64_t i = 0; i < n; ++i) x[i] += 1.0f;
      return;
  }
}

// Every planned row has the tensor's row length and lies inside its source.
void check_rows(const PlannedTensor& t) {
  const int64_t row_len = t.shape.at(0);
  int64_t n_elems = 1;
  for (int64_t d : t.shape) n_elems *= d;
  if (t.n_rows() * row_len != n_elems) {
    throw ConvertError(t.name + ": planned rows (" + std::to_string(t.n_rows()) + " of " + std::to_string(row_len) +
                       ") do not fill its shape");
  }
  if (!t.col_perm.empty()) {
    if (static_cast<int64_t>(t.col_perm.size()) != row_len) throw ConvertError(t.name + ": column order has the wrong length");
    for (int64_t c : t.col_perm)
      if (c < 0 || c >= row_len) throw ConvertError(t.name + ": column order points outside the row");
  }
  for (const RowSpan& r : t.rows) {
    if (r.elem_stride > 0) {
      const int64_t last = r.first_row + (r.n_rows - 1) * r.row_stride + (row_len - 1) * r.elem_stride;
      if (r.n_rows > 0 && (r.first_row < 0 || last >= r.src->n_elements())) {
        throw ConvertError(t.name + ": gathered rows run outside source '" + r.src->name + "'");
      }
    } else if (r.src->row_len() != row_len) {
      throw ConvertError(t.name + ": source '" + r.src->name + "' has rows of " + std::to_string(r.src->row_len()) +
                         ", the GGUF tensor needs " + std::to_string(row_len));
    }
  }
}

// A tensor copied in the block format the checkpoint holds it in (whatever the output type).
void add_raw_tensor(gguf::GgufWriter& w, const ConvertOptions& opt, const PlannedTensor& t, size_t i, size_t n) {
  const int64_t row_len = t.shape.at(0);
  if (row_len % type_traits(t.raw_type).block_elems != 0) {
    throw ConvertError(t.name + ": rows of " + std::to_string(row_len) + " are not whole " +
                       std::string(type_name(t.raw_type)) + " blocks");
  }
  const uint64_t want_bytes = static_cast<uint64_t>(row_bytes(t.raw_type, row_len)) * static_cast<uint64_t>(t.n_rows());
  w.add_tensor(t.name, t.shape, t.raw_type, [&opt, &t, i, n, want_bytes](uint8_t* dst, uint64_t n_bytes) {
    if (n_bytes != want_bytes) {
      throw ConvertError(t.name + ": the writer asks for " + std::to_string(n_bytes) + " bytes, the blocks make " +
                         std::to_string(want_bytes));
    }
    if (opt.progress) opt.progress(i + 1, n, t.name);
    t.raw_fill(dst);
  });
}

}  // namespace

ConvertResult convert_hf_to_gguf(const ConvertOptions& opt) {
  const uint32_t ftype = file_type_id(opt.outtype);
  const fs::path cfg_path = fs::path(opt.hf_dir) / "config.json";
  nlohmann::json config;
  {
    std::ifstream in(cfg_path, std::ios::binary);
    if (!in) throw ConvertError(cfg_path.string() + ": cannot open");
    try {
      config = nlohmann::json::parse(in);
    } catch (const nlohmann::json::exception& e) {
      throw ConvertError(cfg_path.string() + ": invalid JSON: " + e.what());
    }
  }
  if (!config.is_object()) throw ConvertError(cfg_path.string() + ": is not a JSON object");

  const Checkpoint ckpt = Checkpoint::open(opt.hf_dir);
  ConvertPlan plan = plan_checkpoint(config, ckpt);
  ConvertResult result;
  result.arch = plan.arch;
  result.n_tensors = plan.tensors.size();
  result.notes = plan.notes;

  gguf::GgufWriter w;
  w.set("general.architecture", Value::string(plan.arch));
  w.set("general.type", Value::string("model"));
  std::string name = opt.name;
  if (name.empty()) name = fs::path(opt.hf_dir).lexically_normal().filename().string();
  if (name.empty() || name == ".") name = fs::absolute(opt.hf_dir).lexically_normal().parent_path().filename().string();
  w.set("general.name", Value::string(name));
  for (auto& [k, v] : plan.metadata) w.set(k, std::move(v));
  w.set("general.file_type", Value::u32(ftype));
  w.set("general.quantization_version", Value::u32(2));  // ggml's GGML_QNT_VERSION

  const int64_t vocab = config.at("vocab_size").get<int64_t>();  // checked by plan_checkpoint
  if (fs::exists(fs::path(opt.hf_dir) / "tokenizer.json")) {
    for (auto& [k, v] : import_hf_tokenizer(opt.hf_dir, config, vocab, plan.arch)) w.set(k, std::move(v));
  } else {
    result.notes.push_back("no tokenizer.json in " + opt.hf_dir + ": the GGUF has no vocabulary");
  }

  const size_t n = plan.tensors.size();
  for (size_t i = 0; i < n; ++i) {
    const PlannedTensor& t = plan.tensors[i];
    if (t.raw_fill) {
      add_raw_tensor(w, opt, t, i, n);
      continue;
    }
    TensorType type = t.keep_f32 ? TensorType::F32 : opt.outtype;
    const int64_t row_len = t.shape.at(0);
    if (row_len % type_traits(type).block_elems != 0) {
      // Q8_0 needs rows in blocks of 32; like llama.cpp, such tensors stay F16.
      result.notes.push_back(t.name + ": rows of " + std::to_string(row_len) + " do not fill " +
                             std::string(type_name(type)) + " blocks; written as f16");
      type = TensorType::F16;
    }
    check_rows(t);
    const size_t rb = row_bytes(type, row_len);
    const uint64_t want_bytes = static_cast<uint64_t>(rb) * static_cast<uint64_t>(t.n_rows());
    w.add_tensor(t.name, t.shape, type, [&opt, &t, i, n, type, row_len, rb, want_bytes](uint8_t* dst, uint64_t n_bytes) {
      if (n_bytes != want_bytes) {
        throw ConvertError(t.name + ": the writer asks for " + std::to_string(n_bytes) + " bytes, the rows make " +
                           std::to_string(want_bytes));
      }
      if (opt.progress) opt.progress(i + 1, n, t.name);
      std::vector<float> row(static_cast<size_t>(row_len)), src_row;
      uint8_t* out = dst;
      for (const RowSpan& r : t.rows) {
        for (int64_t k = 0; k < r.n_rows; ++k) {
          if (r.elem_stride > 0) r.src->read_strided(r.first_row + k * r.row_stride, r.elem_stride, row_len, row.data());
          else r.src->read_row(r.first_row + k, row.data());
          if (!t.col_perm.empty()) {
            src_row = row;
            for (int64_t c = 0; c < row_len; ++c) row[c] = src_row[t.col_perm[c]];
          }
          apply(t.op, row.data(), row_len);
          quantize_row(type, row.data(), out, row_len);
          out += rb;
        }
      }
    });
  }
  w.write(opt.out_path);
  return result;
}

}  // namespace moraine::convert
