// The kernel tiers this CPU has, for tests that run their body once per tier (the tier goes into
// the tuning they pass: cpu::MatvecTuning::max_isa).
#pragma once
#include <vector>

#include "kernels/cpu/vec_dot.h"

namespace moraine::test {

inline std::vector<cpu::CpuIsa> available_tiers() {
  std::vector<cpu::CpuIsa> tiers;
  for (cpu::CpuIsa isa : {cpu::CpuIsa::Scalar, cpu::CpuIsa::Avx2, cpu::CpuIsa::Avx512, cpu::CpuIsa::Avx512Vnni, cpu::CpuIsa::Amx}) {
    if (static_cast<int>(isa) <= static_cast<int>(cpu::hardware_cpu_isa())) tiers.push_back(isa);
  }
  return tiers;
}

}  // namespace moraine::test
