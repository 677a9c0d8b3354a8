// CPU lists and physical-core discovery from sysfs.
#include "kernels/cpu/cpu_topology.h"

#include <sched.h>

#include <algorithm>
#include <charconv>
#include <fstream>
#include <map>
#include <stdexcept>
#include <utility>

namespace moraine::cpu {
namespace {

int parse_int(std::string_view s, std::string_view whole) {
  int v = 0;
  const auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
  if (s.empty() || ec != std::errc() || end != s.data() + s.size() || v < 0) {
    throw std::invalid_argument("cpu list '" + std::string(whole) + "': '" + std::string(s) + "' is not a CPU number");
  }
  return v;
}

// First line of a sysfs file as an int, or -1 when missing.
int read_sys_int(const std::string& path) {
  std::ifstream f(path);
  int v = -1;
  if (!(f >> v)) return -1;
  return v;
}

}  // namespace

std::vector<int> parse_cpu_list(std::string_view text) {
  std::vector<int> cpus;
  if (text.empty()) throw std::invalid_argument("cpu list is empty");
  size_t pos = 0;
  while (pos <= text.size()) {
    const size_t comma = std::min(text.find(',', pos), text.size());
    const std::string_view part = text.substr(pos, comma - pos);
    const size_t dash = part.find('-');
    if (dash == std::string_view::npos) {
      cpus.push_back(parse_int(part, text));
    } else {
      const int lo = parse_int(part.substr(0, dash), text), hi = parse_int(part.substr(dash + 1), text);
      if (hi < lo) throw std::invalid_argument("cpu list '" + std::string(text) + "': range '" + std::string(part) + "' is reversed");
      if (hi - lo > 65536) throw std::invalid_argument("cpu list '" + std::string(text) + "': range '" + std::string(part) + "' is too large");
      for (int c = lo; c <= hi; ++c) cpus.push_back(c);
    }
    pos = comma + 1;
  }
  std::sort(cpus.begin(), cpus.end());
  cpus.erase(std::unique(cpus.begin(), cpus.end()), cpus.end());
  return cpus;
}

std::string format_cpu_list(const std::vector<int>& cpus) {
  std::string out;
  for (size_t i = 0; i < cpus.size();) {
    size_t j = i;
    while (j + 1 < cpus.size() && cpus[j + 1] == cpus[j] + 1) ++j;
    if (!out.empty()) out += ',';
    out += std::to_string(cpus[i]);
    if (j > i) out += '-' + std::to_string(cpus[j]);
    i = j + 1;
  }
  return out;
}

std::vector<int> allowed_cpus() {
  cpu_set_t set;
  CPU_ZERO(&set);
  std::vector<int> cpus;
  if (sched_getaffinity(0, sizeof(set), &set) != 0) return cpus;
  for (int c = 0; c < CPU_SETSIZE; ++c) {
    if (CPU_ISSET(c, &set)) cpus.push_back(c);
  }
  return cpus;
}

std::vector<int> physical_core_cpus() {
  const std::vector<int> allowed = allowed_cpus();
  std::map<std::pair<int, int>, int> first_of_core;  // (package, core) -> lowest allowed CPU
  for (int c : allowed) {
    const std::string dir = "/sys/devices/system/cpu/cpu" + std::to_string(c) + "/topology/";
    const int pkg = read_sys_int(dir + "physical_package_id"), core = read_sys_int(dir + "core_id");
    if (pkg < 0 || core < 0) return allowed;
    first_of_core.try_emplace({pkg, core}, c);  // allowed is ascending: first seen is lowest
  }
  std::vector<int> cpus;
  for (const auto& [key, c] : first_of_core) cpus.push_back(c);
  std::sort(cpus.begin(), cpus.end());
  return cpus;
}

}  // namespace moraine::cpu
