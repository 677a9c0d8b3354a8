// GgufFile: maps a GGUF file (or every shard of a split model) and exposes its metadata and
// tensors. Parsing of one file image lives in gguf_parse.cpp.
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <map>
#include <unordered_map>

#include "common/gguf/gguf.h"
#include "common/gguf/gguf_parse.h"

namespace moraine::gguf {

int64_t TensorInfo::n_elements() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

namespace {

// A read-only private mapping of a whole file; an empty file has no mapping.
class MappedFile {
 public:
  explicit MappedFile(const std::string& path) {
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) throw GgufError(path + ": cannot open: " + std::strerror(errno));
    struct stat st {};
    if (::fstat(fd, &st) != 0) {
      const int e = errno;
      ::close(fd);
      throw GgufError(path + ": cannot stat: " + std::strerror(e));
    }
    if (!S_ISREG(st.st_mode)) {
      ::close(fd);
      throw GgufError(path + ": not a regular file");
    }
    size_ = static_cast<size_t>(st.st_size);
    if (size_ > 0) {
      void* p = ::mmap(nullptr, size_, PROT_READ, MAP_PRIVATE, fd, 0);
      if (p == MAP_FAILED) {
        const int e = errno;
        ::close(fd);
        throw GgufError(path + ": cannot mmap " + std::to_string(size_) + " bytes: " + std::strerror(e));
      }
      data_ = static_cast<const uint8_t*>(p);
    }
    ::close(fd);
  }
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;
  ~MappedFile() {
    if (data_) ::munmap(const_cast<uint8_t*>(data_), size_);
  }
  const uint8_t* data() const { return data_; }
  size_t size() const { return size_; }

 private:
  const uint8_t* data_ = nullptr;
  size_t size_ = 0;
};

struct SplitName {
  std::string prefix;  // NAME in NAME-0000k-of-0000n.gguf
  uint32_t index = 0;  // k, 1-based
  uint32_t count = 0;  // n
};

// llama.cpp's gguf-split names shards "<prefix>-%05d-of-%05d.gguf".
std::optional<SplitName> parse_split_name(const std::string& path) {
  static constexpr std::string_view kSuffix = ".gguf";
  static constexpr size_t kTailLen = 15;  // "-00001-of-00003"
  if (path.size() < kSuffix.size() + kTailLen) return std::nullopt;
  if (path.compare(path.size() - kSuffix.size(), kSuffix.size(), kSuffix) != 0) return std::nullopt;
  const std::string tail = path.substr(path.size() - kSuffix.size() - kTailLen, kTailLen);
  auto digits = [&](size_t from) {
    uint32_t v = 0;
    for (size_t i = from; i < from + 5; ++i) {
      if (tail[i] < '0' || tail[i] > '9') return uint32_t{0};
      v = v * 10 + static_cast<uint32_t>(tail[i] - '0');
    }
    return v;
  };
  if (tail[0] != '-' || tail.compare(6, 4, "-of-") != 0) return std::nullopt;
  SplitName s{path.substr(0, path.size() - kSuffix.size() - kTailLen), digits(1), digits(10)};
  if (s.index == 0 || s.count == 0 || s.index > s.count) return std::nullopt;
  return s;
}

std::string shard_path(const SplitName& s, uint32_t index) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "-%05u-of-%05u.gguf", index, s.count);
  return s.prefix + buf;
}

std::optional<uint64_t> u64_of(const detail::ParsedShard& shard, std::string_view key) {
  for (const auto& [k, v] : shard.metadata) {
    if (k == key) return v.as_u64();
  }
  return std::nullopt;
}

}  // namespace

struct GgufFile::Impl {
  std::vector<std::unique_ptr<MappedFile>> maps;
  std::vector<uint8_t> owned;  // from_bytes keeps its copy here
  uint32_t version = 3;
  uint64_t alignment = detail::kDefaultAlignment;
  std::vector<std::string> paths;
  uint64_t file_bytes = 0;
  std::vector<uint64_t> data_offsets;  // per shard
  std::vector<std::pair<std::string, Value>> metadata;
  std::vector<TensorInfo> tensors;
  std::map<std::string, size_t, std::less<>> key_index;
  std::map<std::string, size_t, std::less<>> tensor_index;

  void add_shard(detail::ParsedShard&& shard, const std::string& path) {
    const auto shard_no = static_cast<uint32_t>(paths.size());
    if (shard_no == 0) {
      version = shard.version;
      alignment = shard.alignment;
      metadata = std::move(shard.metadata);
      for (size_t i = 0; i < metadata.size(); ++i) key_index.emplace(metadata[i].first, i);
    }
    for (TensorInfo& t : shard.tensors) {
      t.shard = shard_no;
      if (!tensor_index.emplace(t.name, tensors.size()).second) {
        const TensorInfo& first = tensors[tensor_index.find(t.name)->second];
        throw GgufError(path + ": tensor '" + t.name + "' also appears in shard " + paths[first.shard] +
                        " (duplicate tensor name across shards)");
      }
      tensors.push_back(std::move(t));
    }
    paths.push_back(path);
    data_offsets.push_back(shard.data_offset);
  }
};

GgufFile::GgufFile(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
GgufFile::GgufFile(GgufFile&&) noexcept = default;
GgufFile& GgufFile::operator=(GgufFile&&) noexcept = default;
GgufFile::~GgufFile() = default;

GgufFile GgufFile::from_bytes(const uint8_t* data, size_t size, std::string name) {
  auto impl = std::make_unique<Impl>();
  impl->owned.assign(data, data + size);
  impl->file_bytes = size;
  impl->add_shard(detail::parse_shard(impl->owned.data(), size, name), name);
  return GgufFile(std::move(impl));
}

GgufFile GgufFile::open(const std::string& path) {
  auto impl = std::make_unique<Impl>();
  const std::optional<SplitName> split = parse_split_name(path);
  const uint32_t n_shards = split ? split->count : 1;
  for (uint32_t k = 1; k <= n_shards; ++k) {
    const std::string p = split ? shard_path(*split, k) : path;
    auto map = std::make_unique<MappedFile>(p);
    detail::ParsedShard shard = detail::parse_shard(map->data(), map->size(), p);
    const std::optional<uint64_t> count = u64_of(shard, "split.count");
    const std::optional<uint64_t> no = u64_of(shard, "split.no");
    if (!split && count && *count > 1) {
      throw GgufError(p + ": metadata 'split.count': the file is shard " +
                      std::to_string(no.value_or(0) + 1) + " of " + std::to_string(*count) +
                      " of a split model, but its name does not follow NAME-0000k-of-0000n.gguf, so "
                      "the other shards cannot be found");
    }
    if (split && n_shards > 1) {
      if (count != uint64_t{n_shards}) {
        throw GgufError(p + ": metadata 'split.count' is " +
                        (count ? std::to_string(*count) : std::string("missing")) + " but the file name says " +
                        std::to_string(n_shards) + " shards");
      }
      if (no != uint64_t{k - 1}) {
        throw GgufError(p + ": metadata 'split.no' is " + (no ? std::to_string(*no) : std::string("missing")) +
                        " but the file name says shard " + std::to_string(k) + " (split.no " +
                        std::to_string(k - 1) + ")");
      }
    }
    impl->file_bytes += map->size();
    impl->maps.push_back(std::move(map));
    impl->add_shard(std::move(shard), p);
  }
  if (split && n_shards > 1) {
    const std::optional<uint64_t> expected = [&]() -> std::optional<uint64_t> {
      auto it = impl->key_index.find(std::string_view("split.tensors.count"));
      if (it == impl->key_index.end()) return std::nullopt;
      return impl->metadata[it->second].second.as_u64();
    }();
    if (expected && *expected != impl->tensors.size()) {
      throw GgufError(impl->paths[0] + ": metadata 'split.tensors.count' is " + std::to_string(*expected) +
                      " but the " + std::to_string(n_shards) + " shards hold " +
                      std::to_string(impl->tensors.size()) + " tensors");
    }
  }
  return GgufFile(std::move(impl));
}

uint32_t GgufFile::version() const { return impl_->version; }
uint64_t GgufFile::alignment() const { return impl_->alignment; }
const std::vector<std::string>& GgufFile::paths() const { return impl_->paths; }
uint64_t GgufFile::file_bytes() const { return impl_->file_bytes; }
uint64_t GgufFile::data_offset(uint32_t shard) const { return impl_->data_offsets.at(shard); }

const std::vector<std::pair<std::string, Value>>& GgufFile::metadata() const { return impl_->metadata; }

const Value* GgufFile::find(std::string_view key) const {
  auto it = impl_->key_index.find(key);
  return it == impl_->key_index.end() ? nullptr : &impl_->metadata[it->second].second;
}

std::optional<std::string> GgufFile::get_string(std::string_view key) const {
  const Value* v = find(key);
  if (!v || !v->as_string()) return std::nullopt;
  return *v->as_string();
}
std::optional<uint64_t> GgufFile::get_u64(std::string_view key) const {
  const Value* v = find(key);
  return v ? v->as_u64() : std::nullopt;
}
std::optional<int64_t> GgufFile::get_i64(std::string_view key) const {
  const Value* v = find(key);
  return v ? v->as_i64() : std::nullopt;
}
std::optional<double> GgufFile::get_f64(std::string_view key) const {
  const Value* v = find(key);
  return v ? v->as_f64() : std::nullopt;
}
std::optional<bool> GgufFile::get_bool(std::string_view key) const {
  const Value* v = find(key);
  return v ? v->as_bool() : std::nullopt;
}
const Array* GgufFile::get_array(std::string_view key) const {
  const Value* v = find(key);
  return v ? v->as_array() : nullptr;
}

const std::vector<TensorInfo>& GgufFile::tensors() const { return impl_->tensors; }

const TensorInfo* GgufFile::find_tensor(std::string_view name) const {
  auto it = impl_->tensor_index.find(name);
  return it == impl_->tensor_index.end() ? nullptr : &impl_->tensors[it->second];
}

}  // namespace moraine::gguf
