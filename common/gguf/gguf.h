// GGUF v3 reader (over mmap, split shards as one model) and writer.
#pragma once
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "common/formats/tensor_type.h"
#include "common/gguf/gguf_value.h"

namespace moraine::gguf {

// Every malformed-file error: the message names the file, the field and the byte offset.
class GgufError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

struct TensorInfo {
  std::string name;
  std::vector<int64_t> shape;  // ggml order: shape[0] is the contiguous (row) dimension
  TensorType type = TensorType::F32;
  uint64_t offset = 0;         // from the start of its shard's data section
  uint64_t n_bytes = 0;
  uint32_t shard = 0;          // index into GgufFile::paths()
  const uint8_t* data = nullptr;  // mapped bytes (valid while the GgufFile lives)

  int64_t n_elements() const;
  int64_t n_rows() const { return shape.empty() || shape[0] == 0 ? 0 : n_elements() / shape[0]; }
};

class GgufFile {
 public:
  // Opens a file; a shard named NAME-0000k-of-0000n.gguf opens all n shards as one model.
  static GgufFile open(const std::string& path);
  // Parses a file image held in memory (the bytes are copied; `name` appears in errors).
  // No shard joining: the image is one file.
  static GgufFile from_bytes(const uint8_t* data, size_t size, std::string name);
  GgufFile(GgufFile&&) noexcept;
  GgufFile& operator=(GgufFile&&) noexcept;
  ~GgufFile();

  uint32_t version() const;
  uint64_t alignment() const;
  const std::vector<std::string>& paths() const;  // one per shard, in order
  uint64_t file_bytes() const;                     // all shards together
  uint64_t data_offset(uint32_t shard = 0) const;  // start of a shard's (aligned) data section

  // Metadata in file order (of the first shard; split.* keys of later shards are not repeated).
  const std::vector<std::pair<std::string, Value>>& metadata() const;
  const Value* find(std::string_view key) const;
  std::optional<std::string> get_string(std::string_view key) const;
  std::optional<uint64_t> get_u64(std::string_view key) const;
  std::optional<int64_t> get_i64(std::string_view key) const;
  std::optional<double> get_f64(std::string_view key) const;
  std::optional<bool> get_bool(std::string_view key) const;
  const Array* get_array(std::string_view key) const;

  const std::vector<TensorInfo>& tensors() const;
  const TensorInfo* find_tensor(std::string_view name) const;

 private:
  struct Impl;
  explicit GgufFile(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// Writes a GGUF v3 file. Metadata keeps insertion order; setting a key again replaces it.
// Tensor data is written in add order, each aligned to general.alignment (default 32). Data
// comes either as bytes or from a callback that fills the tensor's bytes in place, so large
// files stream to disk without holding the whole model in memory.
class GgufWriter {
 public:
  void set(const std::string& key, Value v);
  void remove(const std::string& key);
  const Value* find(std::string_view key) const;

  using Fill = std::function<void(uint8_t* dst, uint64_t n_bytes)>;
  // `data` is not copied: it must stay valid until write() returns. Throws
  // std::invalid_argument when n_bytes does not match shape and type, or the shape is invalid.
  void add_tensor(std::string name, std::vector<int64_t> shape, TensorType type,
                  const void* data, uint64_t n_bytes);
  void add_tensor(std::string name, std::vector<int64_t> shape, TensorType type, Fill fill);

  // Writes to path + ".tmp" then renames, so a failed write never leaves a half file behind.
  // I/O failures (disk full, ...) throw std::system_error naming the path; the .tmp is removed.
  void write(const std::string& path) const;

 private:
  struct PendingTensor {
    std::string name;
    std::vector<int64_t> shape;
    TensorType type;
    uint64_t n_bytes;
    const void* bytes;  // not owned: must stay valid until write() returns; null when fill is set
    Fill fill;
  };
  uint64_t alignment() const;
  void check_new_tensor(const std::string& name, const std::vector<int64_t>& shape, TensorType type,
                        uint64_t n_bytes) const;
  std::vector<std::pair<std::string, Value>> metadata_;
  std::vector<PendingTensor> tensors_;
};

}  // namespace moraine::gguf
