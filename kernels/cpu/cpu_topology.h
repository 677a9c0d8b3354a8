// Which logical CPUs the CPU expert worker's threads run on.
#pragma once
#include <string>
#include <string_view>
#include <vector>

namespace moraine::cpu {

// "0-3,8,10-11" -> {0,1,2,3,8,10,11} (sorted, unique). Throws std::invalid_argument naming the
// bad part for anything else (empty list, reversed range, non-numbers).
std::vector<int> parse_cpu_list(std::string_view text);
std::string format_cpu_list(const std::vector<int>& cpus);

// One logical CPU per physical core (the lowest-numbered SMT sibling), among the CPUs this
// process may run on (sched_getaffinity), from /sys/devices/system/cpu/*/topology. SMT
// siblings share a core's load ports, so a memory-bound kernel gains nothing from the second
// one. Falls back to every allowed CPU when the topology files are missing.
std::vector<int> physical_core_cpus();

// The CPUs this process may run on.
std::vector<int> allowed_cpus();

}  // namespace moraine::cpu
