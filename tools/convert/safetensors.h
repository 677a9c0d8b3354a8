// Reader for Hugging Face safetensors checkpoints: one model.safetensors, or shards listed by
// model.safetensors.index.json. Files are memory-mapped; nothing is copied until a row is read.
#pragma once
#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

namespace moraine::convert {

// Every refusal of the converter: the message names the file, tensor or config key at fault.
class ConvertError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// U8: packed block data (gpt-oss's MXFP4 `_blocks` and `_scales`), read as bytes, never as floats.
enum class StDtype { F32, F16, BF16, U8 };

struct StTensor {
  std::string name;
  StDtype dtype = StDtype::F32;
  std::vector<int64_t> shape;  // as stored: row-major, outermost dimension first
  const uint8_t* data = nullptr;
  uint64_t n_bytes = 0;
  std::string file;            // the shard it lives in (for messages)

  int64_t n_elements() const;
  // The tensor viewed as a matrix of rows of its innermost dimension (a 1-D tensor is one row).
  int64_t row_len() const { return shape.empty() ? 1 : shape.back(); }
  int64_t n_rows() const { return row_len() == 0 ? 0 : n_elements() / row_len(); }
  bool is_float() const { return dtype != StDtype::U8; }
  // Row `row` of that view, converted to float (a float dtype only).
  void read_row(int64_t row, float* dst) const;
  // n elements from flat index first, stride apart, converted to float (a float dtype only).
  void read_strided(int64_t first, int64_t stride, int64_t n, float* dst) const;
};

class MappedFile;

class Checkpoint {
 public:
  // Opens DIR/model.safetensors, or every shard named by DIR/model.safetensors.index.json.
  static Checkpoint open(const std::string& dir);
  // Opens one safetensors file (tests, tools).
  static Checkpoint open_file(const std::string& path);

  Checkpoint(Checkpoint&&) noexcept;
  Checkpoint& operator=(Checkpoint&&) noexcept;
  ~Checkpoint();

  const StTensor* find(std::string_view name) const;
  const std::vector<StTensor>& tensors() const { return tensors_; }  // sorted by name

 private:
  Checkpoint();
  void add_file(const std::string& path);
  void finish();
  std::vector<std::unique_ptr<MappedFile>> files_;
  std::vector<StTensor> tensors_;
  std::unordered_map<std::string, size_t> index_;
};

}  // namespace moraine::convert
