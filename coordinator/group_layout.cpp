#include "coordinator/group_layout.h"

#include <filesystem>
#include <fstream>
#include <algorithm>
#include <cstdio>
#include <functional>
#include <stdexcept>

#include <nlohmann/json.hpp>

#include "common/gguf/gguf.h"

namespace moraine::group {

namespace fs = std::filesystem;

void GroupManifest::write(const std::string& path) const {
  nlohmann::json j;
  j["model_path"] = model_path;
  j["group_prefix"] = group_prefix;
  j["exchange_locator"] = exchange_locator;
  j["arena_locator"] = arena_locator;
  j["coordinator_pid"] = coordinator_pid;
  j["coordinator_start_ticks"] = coordinator_start_ticks;
  j["n_cpu_workers"] = n_cpu_workers;
  j["max_tokens"] = max_tokens;
  j["zmq_handoff"] = zmq_handoff;
  const std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp, std::ios::trunc);
    out << j.dump(1) << "\n";
    if (!out) throw std::runtime_error("cannot write " + tmp);
  }
  fs::rename(tmp, path);
}

GroupManifest GroupManifest::read(const std::string& path) {
  std::ifstream in(path);
  if (!in) throw std::runtime_error("cannot open group manifest " + path);
  try {
    const nlohmann::json j = nlohmann::json::parse(in);
    GroupManifest m;
    m.model_path = j.at("model_path").get<std::string>();
    m.group_prefix = j.at("group_prefix").get<std::string>();
    m.exchange_locator = j.at("exchange_locator").get<std::string>();
    m.arena_locator = j.at("arena_locator").get<std::string>();
    m.coordinator_pid = j.at("coordinator_pid").get<std::uint32_t>();
    m.coordinator_start_ticks = j.at("coordinator_start_ticks").get<std::uint64_t>();
    m.n_cpu_workers = j.at("n_cpu_workers").get<int>();
    m.max_tokens = j.at("max_tokens").get<int>();
    m.zmq_handoff = j.at("zmq_handoff").get<bool>();
    if (m.n_cpu_workers < 1 || m.max_tokens < 1) throw std::runtime_error("n_cpu_workers and max_tokens must be >= 1");
    return m;
  } catch (const std::exception& e) {
    throw std::runtime_error("group manifest " + path + ": " + e.what());
  }
}

std::string manifest_path(const std::string& socket_dir) { return socket_dir + "/group.json"; }

std::string control_address(const std::string& socket_dir, const std::string& instance) {
  return "unix:" + socket_dir + "/" + instance + ".sock";
}

std::string jobs_endpoint(const std::string& socket_dir, const std::string& instance) {
  return "ipc://" + socket_dir + "/" + instance + ".jobs";
}

std::string group_prefix_for(const std::string& socket_dir) {
  const std::string canon = fs::weakly_canonical(socket_dir).string();
  char buf[32];
  std::snprintf(buf, sizeof buf, "moraine-g%016zx", std::hash<std::string>{}(canon));
  return buf;
}

std::string cpu_worker_instance(int index) { return "cpu_expert_worker-" + std::to_string(index); }

ExchangeLayout ExchangeLayout::build(const model::HParams& hp, int max_tokens, int n_cpu_workers) {
  const std::size_t T = static_cast<std::size_t>(max_tokens);
  const std::size_t k = static_cast<std::size_t>(hp.n_expert_used);
  const std::size_t d = static_cast<std::size_t>(hp.n_embd);
  ExchangeLayout x;
  x.layout.add("step", sizeof(StepHeader))
      .add("expert_req", sizeof(ExpertRequest))
      .add("tokens", T * sizeof(std::int32_t))
      .add("hidden", T * d * sizeof(float))
      .add("chosen", T * k * sizeof(std::int32_t))
      .add("weights", T * k * sizeof(float))
      .add("expert_out", T * k * d * sizeof(float))
      .add("logits", T * static_cast<std::size_t>(hp.n_vocab) * sizeof(float))
      .add_doorbells("bells", 2 * static_cast<std::size_t>(n_cpu_workers));
  return x;
}

ArenaLayout ArenaLayout::build(const model::Model& m) {
  constexpr std::size_t kAlign = 4096;
  ArenaLayout a;
  std::size_t at = 0;
  for (const model::LayerWeights& L : m.layers) {
    std::array<Slice, 3> s;
    const model::ExpertTensor* t[3] = {&L.moe.gate, &L.moe.up, &L.moe.down};
    for (int i = 0; i < 3; ++i) {
      s[i].offset = at;
      s[i].bytes = static_cast<std::size_t>(t[i]->all.n_rows) * t[i]->all.row_bytes;
      at = (at + s[i].bytes + kAlign - 1) / kAlign * kAlign;
    }
    a.layers.push_back(s);
  }
  a.total_bytes = at;
  return a;
}

model::ExpertTensor ArenaLayout::bind(const model::Model& m, std::int64_t il, int which,
                                      const std::byte* arena) const {
  const model::MoeWeights& W = m.layers[il].moe;
  model::ExpertTensor t = which == 0 ? W.gate : which == 1 ? W.up : W.down;
  t.all.data = reinterpret_cast<const uint8_t*>(arena + layers[il][which].offset);
  return t;
}

void ExpertPlan::reserve(std::int64_t n_expert, std::int64_t max_slots) {
  start.assign(static_cast<std::size_t>(n_expert + 1), 0);
  slot_of.assign(static_cast<std::size_t>(max_slots), 0);
  row_of.assign(static_cast<std::size_t>(max_slots), 0);
  cursor.assign(static_cast<std::size_t>(n_expert), 0);
}

void ExpertPlan::build(const std::int32_t* chosen, std::int64_t n_slots, std::int64_t n_expert) {
  std::fill(start.begin(), start.end(), 0);
  for (std::int64_t i = 0; i < n_slots; ++i) {
    if (chosen[i] < 0 || chosen[i] >= n_expert) {
      throw std::runtime_error("routing slot " + std::to_string(i) + " names expert " +
                               std::to_string(chosen[i]) + ", outside [0, " + std::to_string(n_expert) + ")");
    }
    ++start[chosen[i] + 1];
  }
  for (std::int64_t e = 0; e < n_expert; ++e) start[e + 1] += start[e];
  // Fill in ascending slot order: each expert's rows come out sorted by slot, as moe_block
  // gathers them.
  std::copy(start.begin(), start.end() - 1, cursor.begin());
  for (std::int64_t i = 0; i < n_slots; ++i) {
    row_of[i] = cursor[chosen[i]]++;
    slot_of[row_of[i]] = static_cast<std::int32_t>(i);
  }
}

}  // namespace moraine::group
