#include "coordinator/placement.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <numeric>
#include <optional>
#include <sstream>
#include <stdexcept>

#include <nlohmann/json.hpp>

#include "common/fileio/atomic_file.h"
#include "common/model/layer_state.h"
#include "coordinator/json_fields.h"

namespace moraine::group {

const char* tier_name(Tier t) {
  switch (t) {
    case Tier::kVram: return "VRAM";
    case Tier::kRam: return "RAM";
    case Tier::kFile: return "FILE";
  }
  return "?";
}

namespace {

char tier_letter(Tier t) { return t == Tier::kVram ? 'V' : t == Tier::kRam ? 'R' : 'F'; }

std::string lower(std::string s) {
  for (char& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return s;
}

}  // namespace

std::uint64_t parse_byte_budget(const std::string& text, const std::string& what) {
  const std::string t = lower(text);
  if (t == "unlimited" || t == "inf") return kUnlimitedBytes;
  const auto bad = [&](const std::string& why) {
    return std::invalid_argument(what + " '" + text + "': " + why +
                                 " (expected bytes with an optional K/M/G/T suffix, e.g. 12G, 512M, or 'unlimited')");
  };
  std::size_t used = 0;
  double value = 0;
  try {
    value = std::stod(t, &used);
  } catch (const std::exception&) {
    throw bad("not a number");
  }
  if (!std::isfinite(value) || value < 0) throw bad("must be a non-negative number");
  std::string suffix = t.substr(used);
  if (suffix.size() > 1 && suffix.back() == 'b') suffix.pop_back();                 // "GB", "GiB"
  if (suffix.size() == 2 && suffix.back() == 'i') suffix.pop_back();                // "Gi"
  double scale = 1;
  if (suffix == "k") scale = 1024.0;
  else if (suffix == "m") scale = 1024.0 * 1024;
  else if (suffix == "g") scale = 1024.0 * 1024 * 1024;
  else if (suffix == "t") scale = 1024.0 * 1024 * 1024 * 1024;
  else if (!suffix.empty() && suffix != "b") throw bad("unknown suffix '" + t.substr(used) + "'");
  const double bytes = value * scale;
  if (bytes >= 1.8e19) throw bad("too large");
  return static_cast<std::uint64_t>(bytes);
}

std::string format_bytes(std::uint64_t bytes) {
  if (bytes == kUnlimitedBytes) return "unlimited";
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double v = static_cast<double>(bytes);
  int u = 0;
  while (v >= 1024 && u < 4) {
    v /= 1024;
    ++u;
  }
  char buf[32];
  std::snprintf(buf, sizeof buf, u == 0 ? "%.0f %s" : "%.2f %s", v, units[u]);
  return buf;
}

std::int64_t planned_context(const model::Model& m, std::int64_t requested) {
  const auto model_ctx = m.file.get_u64(std::string(m.hp.arch_string()) + ".context_length");
  if (requested < 0) throw std::invalid_argument("--ctx must be >= 0");
  std::int64_t ctx = requested > 0 ? requested : 4096;
  if (model_ctx && *model_ctx > 0) ctx = std::min<std::int64_t>(ctx, static_cast<std::int64_t>(*model_ctx));
  return ctx;
}

ModelSizes model_sizes(const model::Model& m, std::int64_t context, model::KvType kv_type) {
  const model::HParams& hp = m.hp;
  ModelSizes s;
  s.n_layer = hp.n_layer;
  s.n_expert = hp.n_expert;
  s.n_expert_used = hp.n_expert_used;
  s.context = context;
  s.kv_type = kv_type;
  std::uint64_t all = 0;
  for (const gguf::TensorInfo& t : m.file.tensors()) all += t.n_bytes;
  std::uint64_t experts = 0;
  for (const model::LayerWeights& L : m.layers) {
    std::uint64_t one = 0, slot = 0;
    for (const model::ExpertTensor* t : {&L.moe.gate, &L.moe.up, &L.moe.down}) {
      if (t->all.info == nullptr) continue;   // a dense layer: zero-byte "experts", all placed on the device
      experts += t->all.info->n_bytes;
      const std::uint64_t part = static_cast<std::uint64_t>(t->rows_per_expert) * t->all.row_bytes;
      one += part;
      slot += arena_align(part);
    }
    s.expert_bytes.push_back(one);
    s.expert_slot_bytes.push_back(slot);
  }
  s.dense_bytes = all - experts;
  for (std::int64_t il = 0; il < hp.n_layer; ++il) s.kv_bytes += model::layer_state_bytes(hp, il, context, kv_type);
  return s;
}

std::vector<std::int32_t> PlacementPlan::experts_in(std::int64_t layer, Tier tier) const {
  std::vector<std::int32_t> out;
  for (std::int64_t e = 0; e < n_expert; ++e) {
    if (at(layer, e) == tier) out.push_back(static_cast<std::int32_t>(e));
  }
  return out;
}

namespace {

// Candidates of each layer, most popular first (ties: lower id), consumed from the front as
// tiers take them.
struct Candidates {
  std::vector<std::vector<std::int32_t>> order;   // [layer]
  std::vector<std::size_t> next;                  // [layer] first not yet placed
};

// Places experts from the front of each layer's candidates into `tier` within `budget` bytes
// (cost[layer] per expert). Pass 1: every layer gets budget / n_layer. Pass 2: what is left goes
// to the most popular next candidate over all layers (every layer sees the same number of routed
// tokens, so counts compare across layers). Returns the bytes used.
std::uint64_t fill_tier(Tier tier, std::uint64_t budget, const std::vector<std::uint64_t>& cost, const Census& census,
                        Candidates& c, PlacementPlan& plan) {
  const std::int64_t L = plan.n_layer, E = plan.n_expert;
  std::uint64_t used = 0;
  const auto place = [&](std::int64_t il) {
    const std::int32_t e = c.order[il][c.next[il]++];
    plan.tiers[static_cast<std::size_t>(il * E + e)] = tier;
    used += cost[il];
  };
  const auto remaining = [&](std::int64_t il) { return c.next[il] < static_cast<std::size_t>(E); };
  if (budget == kUnlimitedBytes) {
    for (std::int64_t il = 0; il < L; ++il) {
      while (remaining(il)) place(il);
    }
    return used;
  }
  const std::uint64_t share = budget / static_cast<std::uint64_t>(L);
  for (std::int64_t il = 0; il < L; ++il) {
    std::uint64_t layer_used = 0;
    while (remaining(il) && layer_used + cost[il] <= share) {
      layer_used += cost[il];
      place(il);
    }
  }
  for (;;) {
    std::int64_t best = -1;
    for (std::int64_t il = 0; il < L; ++il) {
      if (!remaining(il) || used + cost[il] > budget) continue;
      const std::uint64_t n = census.counts[il][c.order[il][c.next[il]]];
      if (best < 0 || n > census.counts[best][c.order[best][c.next[best]]]) best = il;
    }
    if (best < 0) return used;
    place(best);
  }
}

void add_totals(PlacementPlan& p, const ModelSizes& s) {
  p.vram = p.ram = p.file = {};
  for (std::int64_t il = 0; il < p.n_layer; ++il) {
    for (std::int64_t e = 0; e < p.n_expert; ++e) {
      const Tier t = p.at(il, e);
      TierTotals& tt = t == Tier::kVram ? p.vram : t == Tier::kRam ? p.ram : p.file;
      ++tt.experts;
      tt.bytes += t == Tier::kRam ? s.expert_slot_bytes[il] : s.expert_bytes[il];
    }
  }
}

// FILE-tier experts one worker may have to fetch for one layer: bounded by the k experts one
// token routes to (a decode step), and by what the worker owns in the worst layer.
std::int64_t staging_slots_needed(const PlacementPlan& p, std::int64_t n_expert_used) {
  std::int64_t most = 0;
  for (std::int64_t il = 0; il < p.n_layer; ++il) {
    std::vector<std::int64_t> per_worker(static_cast<std::size_t>(p.n_cpu_workers), 0);
    for (std::int64_t e = 0; e < p.n_expert; ++e) {
      if (p.at(il, e) == Tier::kFile) most = std::max(most, ++per_worker[static_cast<std::size_t>(e % p.n_cpu_workers)]);
    }
  }
  return std::min(most, n_expert_used);
}

// Cache slots per worker that the file-cache share of the RAM budget buys (slots and their
// directory entries); the staging slots are the floor, applied by the caller.
std::int64_t cache_share_slots(const PlacementInput& in, std::uint64_t slot_bytes) {
  const std::uint64_t share = in.file_cache_budget == kAutoFileCache ? in.ram_budget / 4 : in.file_cache_budget;
  if (share >= in.ram_budget) return 0;   // "unlimited" or all of it: the floor (RAM experts would get nothing)
  const std::uint64_t per_slot = static_cast<std::uint64_t>(in.n_cpu_workers) * (slot_bytes + kCacheSlotHeaderBytes);
  std::int64_t n = static_cast<std::int64_t>(share / per_slot);
  while (n > 0 && PlacementPlan::cache_region_bytes(in.n_cpu_workers, n, slot_bytes) > share) --n;
  return n;
}

}  // namespace

PlacementPlan plan_placement(const PlacementInput& in) {
  const ModelSizes& s = in.sizes;
  if (s.n_layer < 1 || s.n_expert < 1) throw std::invalid_argument("placement: the model has no routed experts");
  if (in.n_cpu_workers < 1) throw std::invalid_argument("placement: at least one cpu worker is needed");
  PlacementPlan p;
  p.n_layer = s.n_layer;
  p.n_expert = s.n_expert;
  p.n_cpu_workers = in.n_cpu_workers;
  p.vram_budget = in.vram_budget;
  p.ram_budget = in.ram_budget;
  p.dense_bytes = s.dense_bytes;
  p.kv_bytes = s.kv_bytes;
  p.kv_slots = s.kv_slots;
  p.kv_type = s.kv_type;
  p.device_reserve_bytes = s.device_reserve_bytes;
  p.context = s.context;
  p.tiers.assign(static_cast<std::size_t>(s.n_layer * s.n_expert), Tier::kFile);
  const Census census = in.census.counts.empty() ? Census::uniform(s.n_layer, s.n_expert) : in.census;
  if (static_cast<std::int64_t>(census.counts.size()) != s.n_layer) throw std::invalid_argument("placement: census has the wrong number of layers");

  const std::uint64_t fixed = s.dense_bytes + s.kv_bytes + s.device_reserve_bytes;
  if (in.vram_budget < fixed) {
    throw std::invalid_argument("--vram " + format_bytes(in.vram_budget) + " (" + std::to_string(in.vram_budget) +
                                " bytes) is too small for the dense weights (" + std::to_string(s.dense_bytes) +
                                " bytes) + KV/state for " + std::to_string(s.context) + " tokens (" +
                                std::to_string(s.kv_bytes) + " bytes) + the device's context and scratch (" +
                                std::to_string(s.device_reserve_bytes) + " bytes) = " + std::to_string(fixed) + " bytes");
  }
  Candidates c;
  c.next.assign(static_cast<std::size_t>(s.n_layer), 0);
  for (std::int64_t il = 0; il < s.n_layer; ++il) {
    std::vector<std::int32_t> ids(static_cast<std::size_t>(s.n_expert));
    std::iota(ids.begin(), ids.end(), 0);
    const auto& n = census.counts[il];
    if (static_cast<std::int64_t>(n.size()) != s.n_expert) throw std::invalid_argument("placement: census has the wrong number of experts");
    std::stable_sort(ids.begin(), ids.end(), [&](std::int32_t a, std::int32_t b) { return n[a] > n[b]; });
    c.order.push_back(std::move(ids));
  }
  const std::uint64_t vram_left = in.vram_budget == kUnlimitedBytes ? kUnlimitedBytes : in.vram_budget - fixed;
  fill_tier(Tier::kVram, vram_left, s.expert_bytes, census, c, p);

  // Does everything left fit in RAM? Otherwise the FILE tier needs its cache: per worker at least
  // S staging slots (what one worker owns of the FILE tier in a layer, up to k), or as many as
  // the file-cache share buys, taken from the RAM budget before RAM experts are placed; try every
  // S and keep the one that leaves the most experts in RAM (ties: fewer slots).
  std::uint64_t rest = 0;
  for (std::int64_t il = 0; il < s.n_layer; ++il) {
    rest += (static_cast<std::uint64_t>(s.n_expert) - c.next[il]) * s.expert_slot_bytes[il];
  }
  const std::uint64_t slot_bytes = *std::max_element(s.expert_slot_bytes.begin(), s.expert_slot_bytes.end());
  if (in.ram_budget == kUnlimitedBytes || rest <= in.ram_budget) {
    fill_tier(Tier::kRam, in.ram_budget, s.expert_slot_bytes, census, c, p);
    add_totals(p, s);
    return p;
  }
  const std::int64_t owned = (s.n_expert + in.n_cpu_workers - 1) / in.n_cpu_workers;
  const std::int64_t max_slots = std::min(owned, s.n_expert_used);
  const std::int64_t share_slots = cache_share_slots(in, slot_bytes);
  const auto reserve = [&](std::int64_t slots) {
    return PlacementPlan::cache_region_bytes(in.n_cpu_workers, std::max(slots, share_slots), slot_bytes);
  };
  std::optional<PlacementPlan> best;
  std::int64_t needed = 1;
  for (std::int64_t slots = 1; slots <= max_slots && reserve(slots) <= in.ram_budget; ++slots) {
    PlacementPlan trial = p;
    Candidates tc = c;
    fill_tier(Tier::kRam, in.ram_budget - reserve(slots), s.expert_slot_bytes, census, tc, trial);
    needed = staging_slots_needed(trial, s.n_expert_used);
    if (needed > slots) continue;
    trial.staging_slots = slots;
    trial.cache_slots = std::max(slots, share_slots);
    trial.staging_slot_bytes = slot_bytes;
    add_totals(trial, s);
    if (!best || trial.ram.experts > best->ram.experts) best = std::move(trial);
  }
  if (!best) {
    throw std::invalid_argument("--ram " + format_bytes(in.ram_budget) + " (" + std::to_string(in.ram_budget) +
                                " bytes) is too small for the staging slots file-resident experts need: " +
                                std::to_string(in.n_cpu_workers) + " workers x " + std::to_string(needed) + " slots x " +
                                std::to_string(slot_bytes) + " bytes + their directory = " +
                                std::to_string(PlacementPlan::cache_region_bytes(in.n_cpu_workers, needed, slot_bytes)) + " bytes");
  }
  return *best;
}

std::uint64_t PlacementPlan::cache_region_bytes(int n_cpu_workers, std::int64_t slots_per_worker, std::uint64_t slot_bytes) {
  const std::uint64_t slots = static_cast<std::uint64_t>(n_cpu_workers) * static_cast<std::uint64_t>(slots_per_worker);
  return slots == 0 ? 0 : slots * slot_bytes + arena_align(slots * kCacheSlotHeaderBytes);
}

std::string PlacementPlan::table() const {
  std::ostringstream o;
  char line[256];
  std::snprintf(line, sizeof line, "placement: %lld layers x %lld experts, %d cpu workers, context %lld (%s KV)\n",
                static_cast<long long>(n_layer), static_cast<long long>(n_expert), n_cpu_workers,
                static_cast<long long>(context), model::kv_type_name(kv_type));
  o << line;
  std::snprintf(line, sizeof line, "  %-5s %8s %14s  %s\n", "tier", "experts", "bytes", "budget");
  o << line;
  const std::string kv = kv_slots > 1 ? format_bytes(kv_bytes) + " for " + std::to_string(kv_slots) + " sequence slots"
                                      : format_bytes(kv_bytes);
  std::snprintf(line, sizeof line, "  %-5s %8s %14s  %s (dense %s + KV/state %s + context/scratch %s first)\n", "VRAM",
                std::to_string(vram.experts).c_str(), format_bytes(vram.bytes).c_str(), format_bytes(vram_budget).c_str(),
                format_bytes(dense_bytes).c_str(), kv.c_str(), format_bytes(device_reserve_bytes).c_str());
  o << line;
  std::snprintf(line, sizeof line, "  %-5s %8s %14s  %s (+ file cache %s)\n", "RAM", std::to_string(ram.experts).c_str(),
                format_bytes(ram.bytes).c_str(), format_bytes(ram_budget).c_str(), format_bytes(cache_region_bytes()).c_str());
  o << line;
  std::snprintf(line, sizeof line, "  %-5s %8s %14s  model file, read into the file cache\n", "FILE",
                std::to_string(file.experts).c_str(), format_bytes(file.bytes).c_str());
  o << line;
  if (cache_slots > 0) {
    std::snprintf(line, sizeof line, "  file cache: %d workers x %lld slots of %s (%lld staging: a layer's most), %.1f%% of FILE experts\n",
                  n_cpu_workers, static_cast<long long>(cache_slots), format_bytes(staging_slot_bytes).c_str(),
                  static_cast<long long>(staging_slots),
                  100.0 * static_cast<double>(n_cpu_workers * cache_slots) / static_cast<double>(std::max<std::int64_t>(1, file.experts)));
    o << line;
  }
  return o.str();
}

void PlacementPlan::write(const std::string& path) const {
  nlohmann::json j;
  j["version"] = 1;
  j["n_layer"] = n_layer;
  j["n_expert"] = n_expert;
  j["n_cpu_workers"] = n_cpu_workers;
  j["staging_slots"] = staging_slots;
  j["cache_slots"] = cache_slots;
  j["staging_slot_bytes"] = staging_slot_bytes;
  j["vram_budget"] = vram_budget;
  j["ram_budget"] = ram_budget;
  j["dense_bytes"] = dense_bytes;
  j["kv_bytes"] = kv_bytes;
  j["kv_slots"] = kv_slots;
  j["kv_type"] = model::kv_type_name(kv_type);
  j["device_reserve_bytes"] = device_reserve_bytes;
  j["context"] = context;
  // One string per layer, a letter per expert: V(RAM), R(AM), F(ILE).
  nlohmann::json layers = nlohmann::json::array();
  for (std::int64_t il = 0; il < n_layer; ++il) {
    std::string row;
    for (std::int64_t e = 0; e < n_expert; ++e) row += tier_letter(at(il, e));
    layers.push_back(row);
  }
  j["tiers"] = layers;
  fileio::write_file_atomic(path, j.dump(1) + "\n");
}

PlacementPlan PlacementPlan::read(const std::string& path, const ModelSizes& s) {
  std::ifstream in(path);
  if (!in) throw std::runtime_error("cannot open placement plan " + path);
  try {
    const nlohmann::json j = nlohmann::json::parse(in);
    if (json_integer<int>(j, "version") != 1) throw std::runtime_error("unknown version " + j.at("version").dump());
    PlacementPlan p;
    p.n_layer = json_integer<std::int64_t>(j, "n_layer");
    p.n_expert = json_integer<std::int64_t>(j, "n_expert");
    if (p.n_layer != s.n_layer || p.n_expert != s.n_expert) {
      throw std::runtime_error("it is for " + std::to_string(p.n_layer) + " layers x " + std::to_string(p.n_expert) +
                               " experts, the model has " + std::to_string(s.n_layer) + " x " + std::to_string(s.n_expert));
    }
    p.n_cpu_workers = json_integer<int>(j, "n_cpu_workers");
    p.staging_slots = json_integer<std::int64_t>(j, "staging_slots");
    p.cache_slots = json_integer_or<std::int64_t>(j, "cache_slots", p.staging_slots);
    p.staging_slot_bytes = json_integer<std::uint64_t>(j, "staging_slot_bytes");
    p.vram_budget = json_integer<std::uint64_t>(j, "vram_budget");
    p.ram_budget = json_integer<std::uint64_t>(j, "ram_budget");
    p.dense_bytes = json_integer<std::uint64_t>(j, "dense_bytes");
    p.kv_bytes = json_integer<std::uint64_t>(j, "kv_bytes");
    p.kv_slots = json_integer_or<std::int64_t>(j, "kv_slots", 1);
    p.kv_type = model::parse_kv_type(j.value("kv_type", std::string("f32")), "kv_type");
    p.device_reserve_bytes = json_integer_or<std::uint64_t>(j, "device_reserve_bytes", 0);
    p.context = json_integer<std::int64_t>(j, "context");
    if (p.n_cpu_workers < 1 || p.staging_slots < 0 || p.staging_slots > s.n_expert_used || p.cache_slots < p.staging_slots) {
      throw std::runtime_error("n_cpu_workers, staging_slots or cache_slots out of range");
    }
    const auto rows = j.at("tiers").get<std::vector<std::string>>();
    if (static_cast<std::int64_t>(rows.size()) != p.n_layer) throw std::runtime_error("tiers has the wrong number of layers");
    for (std::size_t il = 0; il < rows.size(); ++il) {
      if (static_cast<std::int64_t>(rows[il].size()) != p.n_expert) {
        throw std::runtime_error("tiers[" + std::to_string(il) + "] has " + std::to_string(rows[il].size()) + " experts");
      }
      for (char ch : rows[il]) {
        if (ch != 'V' && ch != 'R' && ch != 'F') throw std::runtime_error("tiers[" + std::to_string(il) + "]: unknown tier '" + std::string(1, ch) + "'");
        p.tiers.push_back(ch == 'V' ? Tier::kVram : ch == 'R' ? Tier::kRam : Tier::kFile);
      }
    }
    const std::uint64_t max_slot = *std::max_element(s.expert_slot_bytes.begin(), s.expert_slot_bytes.end());
    if (p.staging_slots > 0 && p.staging_slot_bytes < max_slot) throw std::runtime_error("staging slots are smaller than an expert");
    add_totals(p, s);
    if (p.file.experts > 0 && p.staging_slots == 0) throw std::runtime_error("FILE-tier experts but no staging slots");
    return p;
  } catch (const std::exception& e) {
    throw std::runtime_error("placement plan " + path + ": " + e.what());
  }
}

}  // namespace moraine::group
