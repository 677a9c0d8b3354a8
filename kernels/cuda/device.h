// Whether a usable CUDA device is present. CI and the build machine have nvcc but no GPU: the
// CUDA tests call this and skip (with `why`) instead of failing.
#pragma once
#include <string>

namespace moraine::cuda {

bool device_available(std::string* why = nullptr);

}  // namespace moraine::cuda
