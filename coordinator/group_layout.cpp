#include "coordinator/group_layout.h"

#include <filesystem>
#include <fstream>
#include <algorithm>
#include <cstdio>
#include <functional>
#include <stdexcept>

#include <nlohmann/json.hpp>

#include "common/fileio/atomic_file.h"
#include "common/gguf/gguf.h"
#include "coordinator/step_bell.h"
#include "coordinator/json_fields.h"

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
  j["long_step_rows"] = long_step_rows;
  j["zmq_handoff"] = zmq_handoff;
  j["placement_path"] = placement_path;
  j["census_path"] = census_path;
  j["placement_census_path"] = placement_census_path;
  j["vram_adapt_every"] = vram_adapt_every;
  j["step_channel"] = step_channel;
  j["slots"] = slots;
  fileio::write_file_atomic(path, j.dump(1) + "\n");
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
    m.coordinator_pid = json_integer<std::uint32_t>(j, "coordinator_pid");
    m.coordinator_start_ticks = json_integer<std::uint64_t>(j, "coordinator_start_ticks");
    m.n_cpu_workers = json_integer<int>(j, "n_cpu_workers");
    m.max_tokens = json_integer<int>(j, "max_tokens");
    m.long_step_rows = json_integer_or<int>(j, "long_step_rows", 0);
    m.zmq_handoff = j.at("zmq_handoff").get<bool>();
    m.placement_path = j.at("placement_path").get<std::string>();
    m.census_path = j.at("census_path").get<std::string>();
    m.placement_census_path = j.value("placement_census_path", std::string());
    m.vram_adapt_every = json_integer_or<int>(j, "vram_adapt_every", 0);
    m.step_channel = j.value("step_channel", std::string("doorbell"));
    m.slots = json_integer_or<int>(j, "slots", 1);
    if (m.slots < 1 || m.slots > static_cast<int>(kMaxSegments))
      throw std::runtime_error("slots " + std::to_string(m.slots) + ": expected 1.." + std::to_string(kMaxSegments));
    if (m.step_channel != "doorbell" && m.step_channel != "zmq")
      throw std::runtime_error("step_channel \"" + m.step_channel + "\": expected doorbell or zmq");
    if (m.n_cpu_workers < 1 || m.max_tokens < 1) throw std::runtime_error("n_cpu_workers and max_tokens must be >= 1");
    if (m.long_step_rows != 0 && m.long_step_rows <= m.max_tokens)
      throw std::runtime_error("long_step_rows " + std::to_string(m.long_step_rows) + " must be 0 or above max_tokens " +
                               std::to_string(m.max_tokens));
    return m;
  } catch (const std::exception& e) {
    throw std::runtime_error("group manifest " + path + ": " + e.what());
  }
}

std::string manifest_path(const std::string& socket_dir) { return socket_dir + "/group.json"; }
std::string placement_path(const std::string& socket_dir) { return socket_dir + "/placement.json"; }

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

ExchangeLayout ExchangeLayout::build(const model::HParams& hp, int max_tokens, int n_cpu_workers, int long_step_rows) {
  const std::size_t T = static_cast<std::size_t>(max_tokens);
  const std::size_t k = static_cast<std::size_t>(hp.n_expert_used);
  const std::size_t d = static_cast<std::size_t>(hp.n_embd);
  ExchangeLayout x;
  x.layout.add("step", sizeof(StepHeader))
      .add("step_reply", sizeof(StepReply))
      .add("step_server", sizeof(StepServerRecord))
      .add_doorbells("step_bells", 2)
      .add("expert_req", sizeof(ExpertRequest))
      .add("tokens", std::max<std::size_t>(T, static_cast<std::size_t>(std::max(long_step_rows, 0))) * sizeof(std::int32_t))
      .add("hidden", T * d * sizeof(float))
      .add("chosen", T * k * sizeof(std::int32_t))
      .add("weights", T * k * sizeof(float))
      .add("expert_out", T * k * d * sizeof(float))
      .add("logits", T * static_cast<std::size_t>(hp.n_vocab) * sizeof(float))
      .add("resident", static_cast<std::size_t>(hp.n_layer * hp.n_expert))
      .add("worker_errors", static_cast<std::size_t>(n_cpu_workers) * sizeof(WorkerError))
      .add_doorbells("bells", 2 * static_cast<std::size_t>(n_cpu_workers));
  return x;
}

namespace {

const model::ExpertTensor& expert_tensor(const model::Model& m, std::int64_t il, int which) {
  const model::MoeWeights& W = m.layers[static_cast<std::size_t>(il)].moe;
  return which == 0 ? W.gate : which == 1 ? W.up : W.down;
}

// Expert parts of layer il laid out from `at`, each 4 KiB aligned; returns the end.
std::size_t lay_parts(const model::Model& m, std::int64_t il, std::size_t at, ArenaLayout::ExpertSlot& s) {
  const model::MoeWeights& moe = m.layers[static_cast<std::size_t>(il)].moe;
  const std::array<std::size_t, 3> offsets = ArenaLayout::part_offsets(moe);
  for (int w = 0; w < 3; ++w) {
    const model::ExpertTensor& t = expert_tensor(m, il, w);
    s.offset[w] = at + offsets[w];
    s.bytes[w] = static_cast<std::size_t>(t.rows_per_expert) * t.all.row_bytes;
  }
  return at + ArenaLayout::slot_bytes(moe);
}

}  // namespace

ArenaLayout ArenaLayout::build(const model::Model& m, const PlacementPlan& plan) {
  if (plan.n_layer != m.hp.n_layer || plan.n_expert != m.hp.n_expert) {
    throw std::runtime_error("placement plan is for " + std::to_string(plan.n_layer) + " x " + std::to_string(plan.n_expert) +
                             " experts, the model has " + std::to_string(m.hp.n_layer) + " x " + std::to_string(m.hp.n_expert));
  }
  ArenaLayout a;
  a.n_expert = plan.n_expert;
  a.ram_index.assign(plan.tiers.size(), -1);
  std::size_t at = 0;
  for (std::int64_t il = 0; il < plan.n_layer; ++il) {
    for (std::int64_t e = 0; e < plan.n_expert; ++e) {
      if (plan.at(il, e) != Tier::kRam) continue;
      a.ram_index[static_cast<std::size_t>(il * plan.n_expert + e)] = static_cast<std::int32_t>(a.ram_slots.size());
      ExpertSlot s;
      at = lay_parts(m, il, at, s);
      a.ram_slots.push_back(s);
    }
  }
  a.cache_offset = at;
  a.cache_slots = plan.cache_slots;
  a.cache_slot_bytes = static_cast<std::size_t>(plan.staging_slot_bytes);
  const std::size_t slots = static_cast<std::size_t>(plan.n_cpu_workers) * static_cast<std::size_t>(plan.cache_slots);
  a.directory_offset = at + slots * a.cache_slot_bytes;
  at += static_cast<std::size_t>(plan.cache_region_bytes());
  a.total_bytes = at;
  return a;
}

std::array<std::size_t, 3> ArenaLayout::part_offsets(const model::MoeWeights& moe) {
  std::array<std::size_t, 3> off{};
  std::size_t at = 0;
  int w = 0;
  for (const model::ExpertTensor* t : {&moe.gate, &moe.up, &moe.down}) {
    off[static_cast<std::size_t>(w++)] = at;
    at += arena_align(static_cast<std::size_t>(t->rows_per_expert) * t->all.row_bytes);
  }
  return off;
}

std::size_t ArenaLayout::slot_bytes(const model::MoeWeights& moe) {
  return part_offsets(moe)[2] + arena_align(static_cast<std::size_t>(moe.down.rows_per_expert) * moe.down.all.row_bytes);
}

ArenaLayout::ExpertSlot ArenaLayout::cache_slot(const model::Model& m, std::int64_t il, int worker,
                                                std::int64_t slot) const {
  ExpertSlot s;
  const std::size_t base = cache_offset + (static_cast<std::size_t>(worker) * static_cast<std::size_t>(cache_slots) +
                                           static_cast<std::size_t>(slot)) * cache_slot_bytes;
  lay_parts(m, il, base, s);
  return s;
}

std::array<model::Matrix, 3> ArenaLayout::bind(const model::Model& m, std::int64_t il, std::int64_t e,
                                               const ExpertSlot& s, const std::byte* arena) {
  std::array<model::Matrix, 3> out;
  for (int w = 0; w < 3; ++w) {
    out[w] = expert_tensor(m, il, w).expert(e);
    out[w].data = reinterpret_cast<const uint8_t*>(arena + s.offset[w]);
  }
  return out;
}

FileRange expert_file_range(const model::Model& m, std::int64_t il, std::int64_t e, int which) {
  const model::ExpertTensor& t = expert_tensor(m, il, which);
  const gguf::TensorInfo& info = *t.all.info;
  const std::uint64_t bytes = static_cast<std::uint64_t>(t.rows_per_expert) * t.all.row_bytes;
  return {info.shard, m.file.data_offset(info.shard) + info.offset + static_cast<std::uint64_t>(e) * bytes, bytes};
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
