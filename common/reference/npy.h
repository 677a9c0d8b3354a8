// Minimal NumPy .npy (format 1.0) writer and reader for float32 row-major 2-D arrays: the
// format moraine-run writes logits in, so Python (np.load) and our tests read them alike.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace moraine::reference {

// Throws std::runtime_error naming the path on I/O failure.
void write_npy_f32(const std::string& path, const float* data, int64_t rows, int64_t cols);

struct NpyF32 {
  int64_t rows = 0, cols = 0;
  std::vector<float> data;
};
// Reads what write_npy_f32 writes ('<f4', C order, 2-D); throws naming the path otherwise.
NpyF32 read_npy_f32(const std::string& path);

}  // namespace moraine::reference
