// Runs a test body once per kernel tier this CPU has, capping the dispatch with
// set_max_cpu_isa, and restores the cap (and the default tiles) afterwards (also when an assertion returns early).
#pragma once
#include <vector>

#include "kernels/cpu/matvec.h"
#include "kernels/cpu/vec_dot.h"

namespace moraine::test {

struct IsaCapGuard {
  ~IsaCapGuard() {
    cpu::set_max_cpu_isa(cpu::CpuIsa::Amx);
    cpu::set_matvec_tiles({});  // the tests that switch tiles (matvec_tiles) leave the defaults
  }
};

inline std::vector<cpu::CpuIsa> available_tiers() {
  std::vector<cpu::CpuIsa> tiers;
  for (cpu::CpuIsa isa : {cpu::CpuIsa::Scalar, cpu::CpuIsa::Avx2, cpu::CpuIsa::Avx512, cpu::CpuIsa::Avx512Vnni, cpu::CpuIsa::Amx}) {
    if (static_cast<int>(isa) <= static_cast<int>(cpu::hardware_cpu_isa())) tiers.push_back(isa);
  }
  return tiers;
}

}  // namespace moraine::test
