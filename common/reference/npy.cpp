#include "common/reference/npy.h"

#include <cstdio>
#include <cstring>
#include <fstream>
#include <regex>
#include <stdexcept>

#include "common/fileio/atomic_file.h"

namespace moraine::reference {

namespace {
constexpr char kMagic[] = "\x93NUMPY";
}

void write_npy_f32(const std::string& path, const float* data, int64_t rows, int64_t cols) {
  std::string header = "{'descr': '<f4', 'fortran_order': False, 'shape': (" +
                       std::to_string(rows) + ", " + std::to_string(cols) + "), }";
  // Magic (6) + version (2) + header length (2) + header, padded so data starts 64-aligned.
  const size_t total = 10 + header.size() + 1;
  header.append((64 - total % 64) % 64, ' ');
  header.push_back('\n');
  fileio::AtomicFile f(path);
  f.write(kMagic, 6);
  const char version[2] = {1, 0};
  f.write(version, 2);
  const uint16_t len = static_cast<uint16_t>(header.size());
  const char len_le[2] = {static_cast<char>(len & 0xff), static_cast<char>(len >> 8)};
  f.write(len_le, 2);
  f.write(header);
  f.write(data, static_cast<uint64_t>(rows * cols) * 4);
  f.commit();
}

NpyF32 read_npy_f32(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) throw std::runtime_error(path + ": cannot open");
  char pre[10];
  if (!f.read(pre, 10) || std::memcmp(pre, kMagic, 6) != 0 || pre[6] != 1) {
    throw std::runtime_error(path + ": not a version 1 .npy file");
  }
  const size_t len = static_cast<uint8_t>(pre[8]) | (static_cast<size_t>(static_cast<uint8_t>(pre[9])) << 8);
  std::string header(len, '\0');
  if (!f.read(header.data(), static_cast<std::streamsize>(len))) {
    throw std::runtime_error(path + ": truncated header");
  }
  std::smatch m;
  static const std::regex re(
      R"(\{'descr': '<f4', 'fortran_order': False, 'shape': \((\d+), (\d+)\), \})");
  if (!std::regex_search(header, m, re)) {
    throw std::runtime_error(path + ": expected a 2-D little-endian float32 C-order array, header " + header);
  }
  NpyF32 out;
  out.rows = std::stoll(m[1]);
  out.cols = std::stoll(m[2]);
  out.data.resize(static_cast<size_t>(out.rows * out.cols));
  if (!f.read(reinterpret_cast<char*>(out.data.data()),
              static_cast<std::streamsize>(out.data.size() * 4))) {
    throw std::runtime_error(path + ": truncated data");
  }
  return out;
}

}  // namespace moraine::reference
