#include "tools/bench/report.h"

#include <algorithm>
#include <array>
#include <cstdio>

namespace moraine::bench {
namespace {

nlohmann::json opt_number(const std::optional<double>& v) { return v ? nlohmann::json(*v) : nlohmann::json(nullptr); }
nlohmann::json opt_number(const std::optional<uint64_t>& v) { return v ? nlohmann::json(*v) : nlohmann::json(nullptr); }

nlohmann::json timing_json(const Timing& t) {
  return {{"n_tokens", t.n_tokens}, {"tok_s", t.tok_s}, {"stddev", t.stddev}, {"counted_runs", t.counted_runs}};
}

std::string fmt(const char* f, double v) {
  char buf[64];
  std::snprintf(buf, sizeof buf, f, v);
  return buf;
}

std::string gib(double bytes) { return fmt("%.2f GiB", bytes / (1024.0 * 1024.0 * 1024.0)); }
std::string mib(double bytes) { return fmt("%.1f MiB", bytes / (1024.0 * 1024.0)); }
std::string budget(const std::optional<uint64_t>& b) { return b ? gib(static_cast<double>(*b)) : "unlimited"; }

nlohmann::json prefill_bound_json(const PrefillBound& b) {
  return {{"n_tokens", b.n_prompt},
          {"step_rows", b.step_rows},
          {"long_step", b.long_step},
          {"pcie_bytes_per_token", b.pcie_bytes_per_token},
          {"disk_bytes_per_token", b.disk_bytes_per_token},
          {"flops_per_token", b.flops_per_token},
          {"pcie_s_per_token", opt_number(b.pcie_s)},
          {"disk_s_per_token", opt_number(b.disk_s)},
          {"gpu_s_per_token", opt_number(b.gpu_s)},
          {"tok_s", opt_number(b.tok_s)},
          {"limiting", b.limiting.empty() ? nlohmann::json(nullptr) : nlohmann::json(b.limiting)},
          {"share", opt_number(b.share)},
          {"why_none", b.why_none}};
}

nlohmann::json staging_json(const ExpertStaging& s) {
  std::array<int64_t, 3> experts{};   // per tier code: VRAM, RAM, FILE
  for (const uint8_t t : s.tier) ++experts[std::min<size_t>(t, 2)];
  return {{"long_step_rows", s.long_step_rows},
          {"window_rows", s.window_rows},
          {"device_computes", s.device_computes},
          {"experts", {{"vram", experts[0]}, {"ram", experts[1]}, {"file", experts[2]}}},
          {"popularity", s.popularity_note}};
}

nlohmann::json placed_json(const EngineStats& s) {
  nlohmann::json j;
  for (int t = 0; t < kPlacedCount; ++t) j[kPlacedNames[t]] = s.placed_bytes_per_token[t];
  return j;
}

nlohmann::json file_tier_run_json(const FileTierRun& run) {
  const EngineStats::FileCache& fc = run.stats.file_cache;
  return {{"tok_s", run.decode.tok_s},
          {"counted_runs", run.decode.counted_runs},
          {"hits", fc.hits},
          {"misses", fc.misses},
          {"hit_rate", fc.hits + fc.misses > 0 ? nlohmann::json(static_cast<double>(fc.hits) / static_cast<double>(fc.hits + fc.misses))
                                               : nlohmann::json(nullptr)},
          {"bytes_read", fc.bytes_read},
          {"read_ahead", fc.read_ahead},
          {"read_ahead_used", fc.read_ahead_used},
          {"tokens", fc.tokens},
          {"placed_bytes_per_token", placed_json(run.stats)},
          {"disk_bytes_per_token", run.disk.bytes_per_token},
          {"disk_bound_tok_s", opt_number(run.disk.tok_s)},
          {"share_of_disk_bound", opt_number(run.disk.share)},
          {"why_none", run.disk.why_none}};
}

// The FILE tier's section of the table: cold and warm, per placement tier the bytes a token
// computes, the cache's hit rate, what the disk read per token and the bound that sets.
void print_file_tier(const BenchReport& r, std::ostream& out) {
  if (!r.file_tier) return;
  const Measured& disk = r.bandwidth[static_cast<int>(Tier::Disk)];
  out << "\nFILE tier: cold = the first decode run after the engine started, warm = the counted decode runs (stats of the last);"
      << " disk rate " << (disk.bytes_per_s ? fmt("%.2f GB/s", *disk.bytes_per_s / 1e9) : std::string("n/a")) << " (" << disk.note
      << ")\n";
  out << "| cache |          t/s | VRAM /token |  RAM /token | FILE /token | cache hit | disk read /token | disk bound t/s |  share |\n";
  out << "| ----- | -----------: | ----------: | ----------: | ----------: | --------: | ---------------: | -------------: | -----: |\n";
  char line[512];
  for (const auto& [name, run] : {std::pair{"cold", &r.file_tier->cold}, std::pair{"warm", &r.file_tier->warm}}) {
    const EngineStats::FileCache& fc = run->stats.file_cache;
    const std::string hit = fc.hits + fc.misses > 0
                                ? fmt("%.1f%%", 100.0 * static_cast<double>(fc.hits) / static_cast<double>(fc.hits + fc.misses))
                                : "n/a";
    std::snprintf(line, sizeof line, "| %-5s | %12.2f | %11s | %11s | %11s | %9s | %16s | %14s | %6s |\n", name, run->decode.tok_s,
                  mib(run->stats.placed_bytes_per_token[0]).c_str(), mib(run->stats.placed_bytes_per_token[1]).c_str(),
                  mib(run->stats.placed_bytes_per_token[2]).c_str(), hit.c_str(), mib(run->disk.bytes_per_token).c_str(),
                  run->disk.tok_s ? fmt("%.2f", *run->disk.tok_s).c_str() : "n/a",
                  run->disk.share ? fmt("%.1f%%", 100.0 * *run->disk.share).c_str() : "n/a");
    out << line;
    if (!run->disk.tok_s) out << "  " << name << ": no disk bound: " << run->disk.why_none << "\n";
  }
}

// The prefill bound's section of the table: per test what a long step copies and computes.
void print_prefill_bound(const BenchReport& r, std::ostream& out) {
  char line[512];
  out << "\nprefill GEMM rate: engine path "
      << (r.gemm.engine_flops_s ? fmt("%.1f TFLOP/s", *r.gemm.engine_flops_s / 1e12) : "n/a") << " (" << r.gemm.engine_note
      << "); cuBLAS dense BF16 " << (r.gemm.cublas_bf16_flops_s ? fmt("%.1f TFLOP/s", *r.gemm.cublas_bf16_flops_s / 1e12) : "n/a")
      << " (" << r.gemm.cublas_note << ")\n";
  if (r.gemm_step.engine_flops_s)
    out << "  the engine path at a whole long step's rows per expert (not used by the bound): "
        << fmt("%.1f TFLOP/s", *r.gemm_step.engine_flops_s / 1e12) << " (" << r.gemm_step.engine_note << ")\n";
  if (!r.stats.staging || !r.stats.staging->device_computes) {
    out << "prefill bound: n/a (" << r.stats.staging_none << ")\n";
    return;
  }
  const ExpertStaging& st = *r.stats.staging;
  out << "prefill bound: a long step of min(n, " << st.long_step_rows << ") rows in windows of " << st.window_rows
      << "; RAM-tier experts cross PCIe once a step, FILE-tier ones are read once a window; popularity: "
      << st.popularity_note << "\n";
  out << "|   test | step rows | pcie bytes/token | pcie time/token | GFLOP/token | gpu time/token | bound t/s | limit |\n";
  out << "| -----: | --------: | ---------------: | --------------: | ----------: | -------------: | --------: | ----- |\n";
  for (const PrefillBound& b : r.prefill_bound) {
    const std::string pcie_t = b.pcie_s ? fmt("%.4f ms", 1e3 * *b.pcie_s) : "n/a";
    const std::string gpu_t = b.gpu_s ? fmt("%.4f ms", 1e3 * *b.gpu_s) : "n/a";
    const std::string bound = b.tok_s ? fmt("%.1f", *b.tok_s) : "n/a";
    std::snprintf(line, sizeof line, "| %6s | %9lld | %16s | %15s | %11.3f | %14s | %9s | %5s |%s\n",
                  ("pp" + std::to_string(b.n_prompt)).c_str(), static_cast<long long>(b.step_rows),
                  mib(b.pcie_bytes_per_token).c_str(), pcie_t.c_str(), b.flops_per_token / 1e9, gpu_t.c_str(), bound.c_str(),
                  b.limiting.c_str(), b.long_step ? "" : " (one window: the engine runs it as a short step)");
    out << line;
    if (b.disk_bytes_per_token > 0)
      out << "  FILE tier: " << mib(b.disk_bytes_per_token) << " per token from disk"
          << (b.disk_s ? fmt(", %.4f ms", 1e3 * *b.disk_s) : "") << "\n";
    if (!b.tok_s) out << "  n/a: " << b.why_none << "\n";
  }
}

}  // namespace

nlohmann::json report_json(const BenchReport& r) {
  nlohmann::json j;
  j["engine"] = r.engine;
  j["model"] = {{"path", r.model.path},
                {"arch", r.model.arch},
                {"file_bytes", r.model.file_bytes},
                {"n_layer", r.model.n_layer},
                {"n_expert", r.model.n_expert},
                {"n_expert_used", r.model.n_expert_used}};
  j["threads"] = r.threads;
  j["repeat"] = r.repeat;
  j["budgets"] = {{"vram_bytes", opt_number(r.vram_budget)},
                  {"ram_bytes", opt_number(r.ram_budget)},
                  {"applied", r.stats.budgets_applied},
                  {"device_used_bytes", opt_number(r.stats.device_used_bytes > 0
                                                       ? std::optional<uint64_t>(r.stats.device_used_bytes)
                                                       : std::nullopt)}};
  j["prefill"] = nlohmann::json::array();
  for (const Timing& t : r.prefill) j["prefill"].push_back(timing_json(t));
  j["decode"] = timing_json(r.decode);
  for (int t = 0; t < kTierCount; ++t) {
    j["bytes_per_token"][kTierNames[t]] = r.stats.bytes_per_token[t];
    j["hit_rate"][kTierNames[t]] = r.stats.hit_rate[t];
    j["expert_reads"][kTierNames[t]] = r.stats.expert_reads[t];
    j["bandwidth"][kTierNames[t]] = {{"bytes_per_s", opt_number(r.bandwidth[t].bytes_per_s)},
                                     {"note", r.bandwidth[t].note}};
  }
  j["bound"] = {{"tok_s", opt_number(r.bound.tok_s)},
                {"limiting_tier", r.bound.limiting ? nlohmann::json(kTierNames[static_cast<int>(*r.bound.limiting)])
                                                   : nlohmann::json(nullptr)},
                {"why_none", r.bound.why_none}};
  j["share_of_bound"] = opt_number(r.share_of_bound);
  j["prefill_bound"] = nlohmann::json::array();
  for (const PrefillBound& b : r.prefill_bound) j["prefill_bound"].push_back(prefill_bound_json(b));
  j["prefill_gemm"] = {{"engine_flops_s", opt_number(r.gemm.engine_flops_s)},
                       {"engine_note", r.gemm.engine_note},
                       {"cublas_bf16_flops_s", opt_number(r.gemm.cublas_bf16_flops_s)},
                       {"cublas_note", r.gemm.cublas_note},
                       {"rows_per_expert", r.gemm.rows_per_expert},
                       {"step_engine_flops_s", opt_number(r.gemm_step.engine_flops_s)},
                       {"step_engine_note", r.gemm_step.engine_note},
                       {"step_rows_per_expert", r.gemm_step.rows_per_expert}};
  j["prefill_staging"] = r.stats.staging
                             ? staging_json(*r.stats.staging)
                             : nlohmann::json{{"why_none", r.stats.staging_none}};
  j["bandwidth_concurrent"] = {
      {"ram", {{"bytes_per_s", opt_number(r.ram_beside_pcie.bytes_per_s)}, {"note", r.ram_beside_pcie.note}}},
      {"pcie", {{"bytes_per_s", opt_number(r.pcie_beside_ram.bytes_per_s)}, {"note", r.pcie_beside_ram.note}}}};
  j["census"] = r.stats.census;
  j["speculation"] = {{"verify_steps", r.stats.verify_steps},
                      {"drafted_tokens", r.stats.drafted_tokens},
                      {"accepted_draft_tokens", r.stats.accepted_draft_tokens}};
  j["cpu_prefetch"] = {{"guessed", r.stats.prefetch_guessed},
                       {"guessed_right", r.stats.prefetch_guessed_right},
                       {"needed", r.stats.prefetch_needed},
                       {"runs", r.stats.prefetch_runs},
                       {"cut_short", r.stats.prefetch_cut_short}};
  const EngineStats::FileCache& fc = r.stats.file_cache;
  j["file_cache"] = {{"hits", fc.hits}, {"misses", fc.misses}, {"bytes_read", fc.bytes_read},
                     {"read_ahead", fc.read_ahead}, {"read_ahead_used", fc.read_ahead_used}, {"tokens", fc.tokens}};
  j["placed_bytes_per_token"] = placed_json(r.stats);
  if (r.file_tier) {
    const Measured& disk = r.bandwidth[static_cast<int>(Tier::Disk)];
    j["file_tier"] = {{"disk_bytes_per_s", opt_number(disk.bytes_per_s)},
                      {"disk_note", disk.note},
                      {"cold", file_tier_run_json(r.file_tier->cold)},
                      {"warm", file_tier_run_json(r.file_tier->warm)}};
  } else {
    j["file_tier"] = nullptr;
  }
  j["cpu_sleeps"] = {{"doorbell", r.stats.doorbell_sleeps}, {"pool", r.stats.pool_sleeps}, {"spin_cut_short", r.stats.spin_cut_short}};
  auto chain = [](const EngineStats::ChainStage& c) {
    return nlohmann::json{{"p50_us", c.p50_us}, {"p90_us", c.p90_us}, {"samples", c.samples}};
  };
  j["handoff_chain"] = {{"routed_wait", chain(r.stats.routed_wait)},
                        {"expert_handoff", chain(r.stats.expert_handoff)},
                        {"expert_cpu", chain(r.stats.expert_cpu)}};
  return j;
}

void print_table(const BenchReport& r, std::ostream& out) {
  out << "engine: " << r.engine;
  if (r.engine == "cpu-reference") out << " (in-process CPU reference executor, not the process group)";
  out << "\nmodel: " << r.model.path << " (" << r.model.arch << ", " << gib(static_cast<double>(r.model.file_bytes))
      << ", " << r.model.n_layer << " layers, " << r.model.n_expert << " experts top-" << r.model.n_expert_used << ")\n";
  out << "budgets: vram " << budget(r.vram_budget) << ", ram " << budget(r.ram_budget)
      << (r.stats.budgets_applied ? "" : " (recorded; this engine does not apply them)");
  if (r.stats.device_used_bytes > 0)
    out << "; device memory in use (measured, most after a step): " << gib(static_cast<double>(r.stats.device_used_bytes));
  out << "\n";
  if (!r.stats.census.empty()) out << "census: " << r.stats.census << "\n";
  if (r.stats.verify_steps > 0)
    out << "speculation (last run): " << r.stats.verify_steps << " verify steps, " << r.stats.accepted_draft_tokens
        << " of " << r.stats.drafted_tokens << " drafted tokens accepted\n";
  if (r.stats.prefetch_guessed > 0)
    out << "cpu prefetch (last run): " << r.stats.prefetch_guessed_right << " of " << r.stats.prefetch_guessed
        << " experts prefetched were asked for; " << r.stats.prefetch_needed << " asked for at those layers; "
        << r.stats.prefetch_cut_short << " of " << r.stats.prefetch_runs << " prefetches cut short by the next request\n";
  if (const EngineStats::FileCache& fc = r.stats.file_cache; fc.hits + fc.misses > 0) {
    char line[256];
    std::snprintf(line, sizeof line,
                  "file cache (last run): %.1f%% hit (%llu of %llu FILE-tier experts), %.2f MB read from the file per token; "
                  "read ahead %llu experts, %llu used\n",
                  100.0 * static_cast<double>(fc.hits) / static_cast<double>(fc.hits + fc.misses),
                  static_cast<unsigned long long>(fc.hits), static_cast<unsigned long long>(fc.hits + fc.misses),
                  fc.tokens > 0 ? static_cast<double>(fc.bytes_read) / 1e6 / static_cast<double>(fc.tokens) : 0.0,
                  static_cast<unsigned long long>(fc.read_ahead), static_cast<unsigned long long>(fc.read_ahead_used));
    out << line;
  }
  if (r.stats.doorbell_sleeps + r.stats.pool_sleeps + r.stats.spin_cut_short > 0)
    out << "cpu worker sleeps (last run): doorbell " << r.stats.doorbell_sleeps << ", expert threads " << r.stats.pool_sleeps
        << ", polls cut short (a CPU looked shared) " << r.stats.spin_cut_short << "\n";
  if (r.stats.expert_handoff.samples > 0) {
    char chain[256];
    std::snprintf(chain, sizeof chain,
                  "hand-off chain per layer (last run, p50 / p90 us): device to routing %.1f / %.1f, cpu workers %.1f / %.1f "
                  "(their call itself %.1f / %.1f)\n",
                  r.stats.routed_wait.p50_us, r.stats.routed_wait.p90_us, r.stats.expert_handoff.p50_us,
                  r.stats.expert_handoff.p90_us, r.stats.expert_cpu.p50_us, r.stats.expert_cpu.p90_us);
    out << chain;
  }
  out << "\n";

  out << "| engine        | threads |   test |             t/s |   bound t/s | limit |  share |\n";
  out << "| ------------- | ------: | -----: | --------------: | ----------: | ----- | -----: |\n";
  char line[512];
  for (size_t i = 0; i < r.prefill.size(); ++i) {
    const Timing& t = r.prefill[i];
    const PrefillBound* b = i < r.prefill_bound.size() ? &r.prefill_bound[i] : nullptr;
    const std::string pb = b && b->tok_s ? fmt("%.2f", *b->tok_s) : "n/a";
    const std::string ps = b && b->share ? fmt("%.1f%%", 100.0 * *b->share) : "n/a";
    std::snprintf(line, sizeof line, "| %-13s | %7d | %6s | %8.2f ± %5.2f | %11s | %5s | %6s |\n", r.engine.c_str(), r.threads,
                  ("pp" + std::to_string(t.n_tokens)).c_str(), t.tok_s, t.stddev, pb.c_str(), b ? b->limiting.c_str() : "",
                  ps.c_str());
    out << line;
  }
  const std::string bound = r.bound.tok_s ? fmt("%.2f", *r.bound.tok_s) : "n/a";
  const std::string share = r.share_of_bound ? fmt("%.1f%%", 100.0 * *r.share_of_bound) : "n/a";
  std::snprintf(line, sizeof line, "| %-13s | %7d | %6s | %8.2f ± %5.2f | %11s | %5s | %6s |\n", r.engine.c_str(), r.threads,
                ("tg" + std::to_string(r.decode.n_tokens)).c_str(), r.decode.tok_s, r.decode.stddev, bound.c_str(),
                r.bound.limiting ? kTierNames[static_cast<int>(*r.bound.limiting)] : "", share.c_str());
  out << line << "\n";

  out << "| tier | bytes/token | hit rate |   bandwidth | time/token | how measured\n";
  out << "| ---- | ----------: | -------: | ----------: | ---------: | ------------\n";
  for (int t = 0; t < kTierCount; ++t) {
    const double bytes = r.stats.bytes_per_token[t];
    const auto& bw = r.bandwidth[t].bytes_per_s;
    const std::string bws = bw ? fmt("%.2f GB/s", *bw / 1e9) : "n/a";
    const std::string per = bw && bytes > 0 ? fmt("%.3f ms", 1e3 * bytes / *bw) : "-";
    std::snprintf(line, sizeof line, "| %-4s | %11s | %7.1f%% | %11s | %10s | %s\n", kTierNames[t], mib(bytes).c_str(),
                  100.0 * r.stats.hit_rate[t], bws.c_str(), per.c_str(), r.bandwidth[t].note.c_str());
    out << line;
  }
  if (r.ram_beside_pcie.bytes_per_s && r.pcie_beside_ram.bytes_per_s) {
    std::snprintf(line, sizeof line, "\nram and pcie at once: %.2f GB/s DRAM read + %.2f GB/s host->device = %.2f GB/s (%s)\n",
                  *r.ram_beside_pcie.bytes_per_s / 1e9, *r.pcie_beside_ram.bytes_per_s / 1e9,
                  (*r.ram_beside_pcie.bytes_per_s + *r.pcie_beside_ram.bytes_per_s) / 1e9, r.pcie_beside_ram.note.c_str());
    out << line;
  }
  if (r.bound.tok_s) {
    out << "\nbound: " << bound << " tok/s (limited by " << kTierNames[static_cast<int>(*r.bound.limiting)]
        << "); decode reached " << share << " of it\n";
  } else {
    out << "\nbound: n/a (" << r.bound.why_none << ")\n";
  }
  print_file_tier(r, out);
  print_prefill_bound(r, out);
}

}  // namespace moraine::bench
