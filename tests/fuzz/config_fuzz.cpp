// libFuzzer target: the files the group reads at start. The first byte picks the reader, the
// rest is the file: the census (Census::read), the placement plan (PlacementPlan::read), the
// group manifest (GroupManifest::read), a --config file (CLI11's TOML/INI reader on a `start`
// subcommand shaped as the supervisor's, falling through from the top level as it does), and the
// byte budgets (--vram 12G) those options carry. Each either reads or throws the error its
// header documents naming the file (runtime_error; CLI::ParseError; invalid_argument naming the
// option); any other exception aborts.
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <fstream>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>

#include "coordinator/census.h"
#include "coordinator/group_layout.h"
#include "coordinator/placement.h"

namespace {

namespace group = moraine::group;

[[noreturn]] void fail(const char* what, const std::string& detail) {
  std::fprintf(stderr, "config_fuzz: %s: %s\n", what, detail.c_str());
  std::abort();
}

const std::string& scratch_path() {
  static const std::string path = [] {
    const char* dir = std::getenv("TMPDIR");
    return std::string(dir ? dir : "/tmp") + "/config_fuzz_" + std::to_string(::getpid()) + ".json";
  }();
  return path;
}

void expect_named(const std::exception& e) {
  if (std::string(e.what()).find(scratch_path()) == std::string::npos) fail("error does not name the file", e.what());
}

group::ModelSizes sizes() {
  group::ModelSizes s;
  s.n_layer = 2;
  s.n_expert = 4;
  s.n_expert_used = 2;
  s.dense_bytes = 1 << 20;
  s.expert_bytes.assign(2, 3 << 12);
  s.expert_slot_bytes.assign(2, 3 << 12);
  return s;
}

void read_config(const std::string& path) {
  CLI::App app{"config_fuzz"};
  app.set_config("--config", "", "TOML/INI");
  CLI::App* st = app.add_subcommand("start");
  st->fallthrough();
  std::string model, vram = "unlimited", handoff = "doorbell";
  int workers = 1, parallel = 1;
  std::int64_t long_rows = 0;
  bool no_census = false;
  std::vector<std::string> extra;
  st->add_option("-m,--model", model);
  st->add_option("--cpu-workers", workers);
  st->add_option("--vram", vram);
  st->add_option("--handoff", handoff)->check(CLI::IsMember({"doorbell", "zmq"}));
  st->add_option("--long-step-rows", long_rows)->check(CLI::NonNegativeNumber)->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
  st->add_option("--parallel", parallel)->check(CLI::Range(1, 256));
  st->add_flag("--no-census", no_census);
  st->add_option("--cpu-worker-arg", extra)->allow_extra_args(false);
  std::vector<std::string> args = {"start", "--config", path};
  std::vector<const char*> argv = {"config_fuzz"};
  for (const std::string& a : args) argv.push_back(a.c_str());
  try {
    app.parse(static_cast<int>(argv.size()), argv.data());
  } catch (const CLI::ParseError&) {
    return;   // CLI11 names the option or the line; moraine prints it and exits 1
  }
  try {
    (void)group::parse_byte_budget(vram, "--vram");
  } catch (const std::invalid_argument& e) {
    if (std::string(e.what()).find("--vram") == std::string::npos) fail("budget error does not name the option", e.what());
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const std::string file(reinterpret_cast<const char*>(data) + 1, size - 1);
  {
    std::ofstream out(scratch_path(), std::ios::binary | std::ios::trunc);
    out << file;
  }
  try {
    switch (data[0] % 5) {
      case 0: {
        const group::Census c = group::Census::read(scratch_path(), 2, 4);
        if (c.counts.size() != 2 || c.counts[0].size() != 4 || c.counts[1].size() != 4) fail("census of the wrong shape", file);
        break;
      }
      case 1: {
        const group::PlacementPlan p = group::PlacementPlan::read(scratch_path(), sizes());
        if (p.tiers.size() != 8) fail("placement of the wrong shape", file);
        (void)p.table();
        break;
      }
      case 2: (void)group::GroupManifest::read(scratch_path()); break;
      case 3: read_config(scratch_path()); break;
      default:
        try {
          (void)group::parse_byte_budget(file, "--ram");
        } catch (const std::invalid_argument& e) {
          if (std::string(e.what()).find("--ram") == std::string::npos) fail("budget error does not name the option", e.what());
        }
    }
  } catch (const std::runtime_error& e) {
    expect_named(e);
  } catch (const std::exception& e) {
    fail("a reader threw something other than runtime_error", e.what());
  }
  return 0;
}
