// The group exactly as deploy/demo and the README start it: `moraine-supervisor start -m MODEL
// --cpu-workers 2 --socket-dir DIR` and every other option the supervisor's default (the CPU
// backend, 512-row steps, `--vram dense`, the census written beside the model), on the demo's
// built-in model (models/moraine-tiny-qwen3next.gguf, trained by tools/train). Its tokens, for the demo's prompt text through `moraine generate` as a user
// types it, must be the reference executor's greedy tokens on the same file. This configuration
// crashed the gpu_worker at main 3f23806 (the staging rule read an arena layout only the CUDA
// backend maps) while every test with the harness's own options passed.
#include <gtest/gtest.h>

#include <filesystem>
#include <nlohmann/json.hpp>

#include "common/model/model.h"
#include "common/tokenizer/tokenizer.h"
#include "tests/group/group_harness.h"

namespace moraine::group_test {
namespace {

namespace fs = std::filesystem;

const fs::path kSource = MORAINE_SOURCE_DIR;
const fs::path kBuild = MORAINE_BUILD_DIR;
// deploy/demo's default prompt and model (tools/train's trained file, committed).
constexpr const char* kDemoPrompt = "A list is a mutable sequence";

// A copy of the demo's model in `dir`: the group writes its census beside the model.
std::string make_demo_model(const std::string& dir) {
  const std::string model = dir + "/moraine-tiny-qwen3next.gguf";
  fs::copy_file(kSource / "models" / "moraine-tiny-qwen3next.gguf", model, fs::copy_options::overwrite_existing);
  return model;
}

TEST(DemoGroup, SupervisorDefaultsGiveTheReferenceTokens) {
  constexpr int kTokens = 16;   // deploy/demo's `moraine generate -n 16 --temp 0 --ignore-eos`
  const std::string dir = temp_dir("demo");
  const std::string model = make_demo_model(dir);
  const model::Model m = model::Model::load(model);
  const std::vector<int32_t> prompt = tokenizer::Tokenizer::from_gguf(m.file).encode(kDemoPrompt);
  ASSERT_GT(prompt.size(), 4u);
  // The CPU backend's KV type (F32); deploy/demo generates past end-of-generation tokens.
  const ReferenceRun ref = reference_greedy(model, prompt, kTokens, model::KvType::F32, /*ignore_eos=*/true);
  ASSERT_EQ(ref.ids.size(), static_cast<size_t>(kTokens));

  GroupOptions o;
  o.model = model;
  o.supervisor_defaults = true;
  Group g(o);
  const auto [rc, out] = run_command(shell_quote((kBuild / "coordinator" / "moraine").string()) + " generate --socket-dir " +
                                         shell_quote(g.socket_dir()) + " -p " + shell_quote(kDemoPrompt) + " -n " +
                                         std::to_string(kTokens) + " --temp 0 --ignore-eos --json",
                                     /*merge_stderr=*/false);
  ASSERT_EQ(rc, 0) << out;
  const nlohmann::json j = nlohmann::json::parse(out);
  EXPECT_EQ(j.at("prompt_tokens").get<size_t>(), prompt.size());
  EXPECT_EQ(j.at("generated_ids").get<std::vector<int32_t>>(), ref.ids);

  // Nothing died on the way: a gpu_worker that crashed and came back (the supervisor restarts it)
  // could still have answered a later request.
  const auto [src, stats] = run_command(shell_quote((kBuild / "coordinator" / "moraine").string()) + " stats --socket-dir " +
                                        shell_quote(g.socket_dir()) + " --json",
                                        /*merge_stderr=*/false);
  ASSERT_EQ(src, 0) << stats;
  const nlohmann::json procs = nlohmann::json::parse(stats);
  ASSERT_TRUE(procs.is_array());
  EXPECT_GE(procs.size(), 5u) << stats;   // supervisor, coordinator, gpu_worker, two cpu workers
  bool saw_supervisor = false;
  for (const nlohmann::json& p : procs) {
    if (p.at("role") != "ROLE_SUPERVISOR") continue;
    saw_supervisor = true;
    EXPECT_EQ(p.at("counters").value("restarts", uint64_t{1}), 0u) << stats;
  }
  EXPECT_TRUE(saw_supervisor) << stats;
  g.stop();
  fs::remove_all(dir);
}

}  // namespace
}  // namespace moraine::group_test
