#include "tools/convert/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <stdexcept>

#include "common/formats/quant.h"

namespace moraine::convert {

namespace fs = std::filesystem;
using nlohmann::json;

class MappedFile {
 public:
  explicit MappedFile(const std::string& path) : path_(path) {
    fd_ = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd_ < 0) throw ConvertError(path + ": cannot open: " + std::strerror(errno));
    struct stat st {};
    if (::fstat(fd_, &st) != 0) {
      ::close(fd_);
      throw ConvertError(path + ": cannot stat: " + std::strerror(errno));
    }
    size_ = static_cast<uint64_t>(st.st_size);
    if (size_ > 0) {
      void* p = ::mmap(nullptr, size_, PROT_READ, MAP_PRIVATE, fd_, 0);
      if (p == MAP_FAILED) {
        ::close(fd_);
        throw ConvertError(path + ": cannot mmap: " + std::strerror(errno));
      }
      data_ = static_cast<const uint8_t*>(p);
    }
  }
  ~MappedFile() {
    if (data_) ::munmap(const_cast<uint8_t*>(data_), size_);
    if (fd_ >= 0) ::close(fd_);
  }
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;

  const uint8_t* data() const { return data_; }
  uint64_t size() const { return size_; }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  int fd_ = -1;
  const uint8_t* data_ = nullptr;
  uint64_t size_ = 0;
};

int64_t StTensor::n_elements() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

namespace {

float element(StDtype dtype, const uint8_t* p) {
  uint16_t h;
  switch (dtype) {
    case StDtype::F32: {
      float f;
      std::memcpy(&f, p, 4);
      return f;
    }
    case StDtype::F16: std::memcpy(&h, p, 2); return fp16_to_fp32(h);
    case StDtype::BF16: std::memcpy(&h, p, 2); return bf16_to_fp32(h);
    case StDtype::U8: break;
  }
  throw std::logic_error("safetensors: a U8 tensor read as floats");
}

}  // namespace

void StTensor::read_strided(int64_t first, int64_t stride, int64_t n, float* dst) const {
  const uint64_t elem = dtype == StDtype::F32 ? 4 : 2;
  if (!is_float()) throw std::logic_error("safetensors: " + name + " (U8) read as floats");
  for (int64_t i = 0; i < n; ++i) dst[i] = element(dtype, data + static_cast<uint64_t>(first + i * stride) * elem);
}

void StTensor::read_row(int64_t row, float* dst) const {
  const int64_t n = row_len();
  if (!is_float()) throw std::logic_error("safetensors: " + name + " (U8) read as floats");
  const uint64_t elem = dtype == StDtype::F32 ? 4 : 2;
  const uint8_t* p = data + static_cast<uint64_t>(row) * static_cast<uint64_t>(n) * elem;
  switch (dtype) {
    case StDtype::F32: std::memcpy(dst, p, static_cast<size_t>(n) * 4); return;
    case StDtype::F16:
      for (int64_t i = 0; i < n; ++i) {
        uint16_t h;
        std::memcpy(&h, p + 2 * i, 2);
        dst[i] = fp16_to_fp32(h);
      }
      return;
    case StDtype::BF16:
      for (int64_t i = 0; i < n; ++i) {
        uint16_t h;
        std::memcpy(&h, p + 2 * i, 2);
        dst[i] = bf16_to_fp32(h);
      }
      return;
    case StDtype::U8: return;  // refused above
  }
}

Checkpoint::Checkpoint() = default;
Checkpoint::Checkpoint(Checkpoint&&) noexcept = default;
Checkpoint& Checkpoint::operator=(Checkpoint&&) noexcept = default;
Checkpoint::~Checkpoint() = default;

namespace {

// Safetensors dtype names this converter reads; any other (F8_E4M3, I64, ...) is refused by name.
// U8 holds packed blocks (MXFP4); a U8 tensor where floats are expected is refused by the planner.
bool parse_dtype(const std::string& s, StDtype& out, uint64_t& elem_bytes) {
  if (s == "F32") { out = StDtype::F32; elem_bytes = 4; return true; }
  if (s == "F16") { out = StDtype::F16; elem_bytes = 2; return true; }
  if (s == "BF16") { out = StDtype::BF16; elem_bytes = 2; return true; }
  if (s == "U8") { out = StDtype::U8; elem_bytes = 1; return true; }
  return false;
}

json read_json_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw ConvertError(path + ": cannot open");
  try {
    return json::parse(in);
  } catch (const json::exception& e) {
    throw ConvertError(path + ": invalid JSON: " + e.what());
  }
}

}  // namespace

void Checkpoint::add_file(const std::string& path) {
  auto file = std::make_unique<MappedFile>(path);
  const uint64_t size = file->size();
  if (size < 8) throw ConvertError(path + ": too small for a safetensors header (" + std::to_string(size) + " bytes)");
  uint64_t header_len = 0;
  std::memcpy(&header_len, file->data(), 8);  // little-endian on every host we build for
  if (header_len > size - 8) {
    throw ConvertError(path + ": header length " + std::to_string(header_len) + " at offset 0 runs past the end of the " +
                       std::to_string(size) + "-byte file");
  }
  json header;
  try {
    header = json::parse(file->data() + 8, file->data() + 8 + header_len);
  } catch (const json::exception& e) {
    throw ConvertError(path + ": header is not valid JSON: " + e.what());
  }
  if (!header.is_object()) throw ConvertError(path + ": header is not a JSON object");
  const uint64_t data_start = 8 + header_len;
  const uint64_t data_len = size - data_start;
  for (auto it = header.begin(); it != header.end(); ++it) {
    if (it.key() == "__metadata__") continue;
    const std::string where = path + ": tensor '" + it.key() + "'";
    const json& v = it.value();
    if (!v.is_object() || !v.contains("dtype") || !v.contains("shape") || !v.contains("data_offsets")) {
      throw ConvertError(where + ": entry needs dtype, shape and data_offsets");
    }
    StTensor t;
    t.name = it.key();
    t.file = path;
    uint64_t elem = 0;
    if (!v["dtype"].is_string() || !parse_dtype(v["dtype"].get<std::string>(), t.dtype, elem)) {
      throw ConvertError(where + ": dtype " + v["dtype"].dump() + " is not supported (F32, F16, BF16 and U8 are)");
    }
    if (!v["shape"].is_array()) throw ConvertError(where + ": shape is not an array");
    uint64_t n = 1;
    for (const json& d : v["shape"]) {
      if (!d.is_number_integer() || d.get<int64_t>() < 0) throw ConvertError(where + ": bad dimension " + d.dump());
      t.shape.push_back(d.get<int64_t>());
      n *= static_cast<uint64_t>(d.get<int64_t>());
    }
    const json& off = v["data_offsets"];
    if (!off.is_array() || off.size() != 2 || !off[0].is_number_unsigned() || !off[1].is_number_unsigned()) {
      throw ConvertError(where + ": data_offsets must be two unsigned integers");
    }
    const uint64_t begin = off[0].get<uint64_t>(), end = off[1].get<uint64_t>();
    if (begin > end || end > data_len) {
      throw ConvertError(where + ": data_offsets [" + std::to_string(begin) + ", " + std::to_string(end) +
                         ") fall outside the " + std::to_string(data_len) + "-byte data section");
    }
    if (end - begin != n * elem) {
      throw ConvertError(where + ": holds " + std::to_string(end - begin) + " bytes but its shape and dtype need " +
                         std::to_string(n * elem));
    }
    t.data = file->data() + data_start + begin;
    t.n_bytes = end - begin;
    if (index_.count(t.name)) throw ConvertError(where + ": also present in " + tensors_[index_[t.name]].file);
    index_[t.name] = tensors_.size();
    tensors_.push_back(std::move(t));
  }
  files_.push_back(std::move(file));
}

void Checkpoint::finish() {
  std::sort(tensors_.begin(), tensors_.end(), [](const StTensor& a, const StTensor& b) { return a.name < b.name; });
  index_.clear();
  for (size_t i = 0; i < tensors_.size(); ++i) index_[tensors_[i].name] = i;
}

Checkpoint Checkpoint::open_file(const std::string& path) {
  Checkpoint c;
  c.add_file(path);
  c.finish();
  return c;
}

Checkpoint Checkpoint::open(const std::string& dir) {
  const fs::path single = fs::path(dir) / "model.safetensors";
  const fs::path index = fs::path(dir) / "model.safetensors.index.json";
  Checkpoint c;
  if (fs::exists(index)) {
    const json j = read_json_file(index.string());
    if (!j.contains("weight_map") || !j["weight_map"].is_object()) {
      throw ConvertError(index.string() + ": has no weight_map object");
    }
    std::set<std::string> shards;
    for (auto it = j["weight_map"].begin(); it != j["weight_map"].end(); ++it) {
      if (!it.value().is_string()) throw ConvertError(index.string() + ": weight_map['" + it.key() + "'] is not a file name");
      shards.insert(it.value().get<std::string>());
    }
    for (const std::string& s : shards) {
      if (s.find('/') != std::string::npos) throw ConvertError(index.string() + ": shard name '" + s + "' has a path in it");
      c.add_file((fs::path(dir) / s).string());
    }
    c.finish();
    for (auto it = j["weight_map"].begin(); it != j["weight_map"].end(); ++it) {
      const StTensor* t = c.find(it.key());
      const std::string shard = (fs::path(dir) / it.value().get<std::string>()).string();
      if (!t || t->file != shard) {
        throw ConvertError(index.string() + ": tensor '" + it.key() + "' is not in " + it.value().get<std::string>());
      }
    }
    return c;
  }
  if (fs::exists(single)) {
    c.add_file(single.string());
    c.finish();
    return c;
  }
  throw ConvertError(dir + ": has neither model.safetensors nor model.safetensors.index.json");
}

const StTensor* Checkpoint::find(std::string_view name) const {
  auto it = index_.find(std::string(name));
  return it == index_.end() ? nullptr : &tensors_[it->second];
}

}  // namespace moraine::convert
