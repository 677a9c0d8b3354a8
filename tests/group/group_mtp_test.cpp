// MTP speculation through the process group on the CPU backend (coordinator --speculate-mtp,
// StepHeader::mtp, gpu_worker/mtp_head.h): the gpu_worker's MTP head drafts after every step, the
// coordinator verifies them as one window, and greedy output is the reference's token for token.
//  - the built-in model (models/moraine-tiny-qwen3next.gguf: DeltaNet layers, so a rejection
//    restores the snapshot before the window), on a readable prompt: drafts used, accepted and
//    rejected; its acceptance printed;
//  - an attention-only qwen3next with an MTP block (random weights): rejections rewind the caches
//    to the accepted position; the head follows;
//  - a speculating request after a plain one whose steps the head did not see: suffix drafts
//    where the cache was reused without a reset;
//  - --speculate-mtp 0: the suffix drafter as before, no MTP drafts;
//  - a sampled request (temperature, top-k, top-p, a penalty) with speculation: every verified
//    row's logits come back and the coordinator samples speculatively (Sequence::speculate); suffix
//    drafts only (the MTP head drafts greedily after the row's argmax).
#include <gtest/gtest.h>

#include <cstdio>
#include <filesystem>
#include <string>
#include <vector>

#include "common/model/model.h"
#include "common/tokenizer/tokenizer.h"
#include "tests/group/group_harness.h"
#include "tests/reference/synthetic_model.h"

namespace moraine::group_test {
namespace {

namespace fs = std::filesystem;

const std::string kBuiltin = std::string(MORAINE_SOURCE_DIR) + "/models/moraine-tiny-qwen3next.gguf";

struct Counters {
  uint64_t verify = 0, drafted = 0, accepted = 0, mtp_used = 0, mtp_none = 0;
  static Counters read(const std::string& dir) {
    return {coordinator_counter(dir, "verify_steps"), coordinator_counter(dir, "drafted_tokens"),
            coordinator_counter(dir, "accepted_draft_tokens"), coordinator_counter(dir, "mtp_drafts_used"),
            coordinator_counter(dir, "mtp_no_drafts")};
  }
  Counters operator-(const Counters& o) const {
    return {verify - o.verify, drafted - o.drafted, accepted - o.accepted, mtp_used - o.mtp_used, mtp_none - o.mtp_none};
  }
};

std::vector<int32_t> tokenize(const std::string& model_path, const std::string& text) {
  const model::Model m = model::Model::load(model_path);
  return tokenizer::Tokenizer::from_gguf(m.file).encode(text, true, false);
}

// Speculative generations (with and without check_logits) of `n` tokens from `prompt` in group `o`,
// then a plain one, then a speculative one again: all the reference's greedy tokens. Returns the
// counters' change over the first two, and over the last one (after a request whose steps the head
// did not see: it follows again only from a reset, which a reused prompt prefix skips).
struct Runs {
  Counters first, after_plain;
};
Runs speculate_twice(const GroupOptions& o, const std::vector<int32_t>& prompt, int n) {
  const ReferenceRun ref = reference_greedy(o.model, prompt, n);
  Group g(o);
  const Counters before = Counters::read(g.socket_dir());
  for (const bool check : {false, true}) {
    const Generation gen = generate(g.socket_dir(), prompt, n, check, /*speculate=*/true);
    EXPECT_TRUE(gen.error.empty()) << gen.error;
    EXPECT_EQ(gen.ids, ref.ids) << (check ? "with" : "without") << " check_logits";
  }
  const Counters c = Counters::read(g.socket_dir()) - before;
  // And plainly: the same tokens without speculation (no MTP head runs).
  const Generation plain = generate(g.socket_dir(), prompt, n);
  EXPECT_TRUE(plain.error.empty()) << plain.error;
  EXPECT_EQ(plain.ids, ref.ids) << "without speculation";
  const Counters before_last = Counters::read(g.socket_dir());
  const Generation last = generate(g.socket_dir(), prompt, n, false, /*speculate=*/true);
  EXPECT_TRUE(last.error.empty()) << last.error;
  EXPECT_EQ(last.ids, ref.ids) << "speculating after a plain request";
  const Counters after_plain = Counters::read(g.socket_dir()) - before_last;
  g.stop();
  std::printf("speculation: %llu verify steps, %llu of %llu drafted tokens accepted (%.3f), %llu MTP drafts used, "
              "%llu steps without MTP drafts\n",
              static_cast<unsigned long long>(c.verify), static_cast<unsigned long long>(c.accepted),
              static_cast<unsigned long long>(c.drafted), c.drafted ? double(c.accepted) / double(c.drafted) : 0.0,
              static_cast<unsigned long long>(c.mtp_used), static_cast<unsigned long long>(c.mtp_none));
  return {c, after_plain};
}

// --speculate-mtp 1 (the default) and 3 (windows rejected at every depth).
class GroupMtpDrafts : public ::testing::TestWithParam<int> {};

TEST_P(GroupMtpDrafts, BuiltinModelDraftsGiveTheReferenceTokens) {
  const std::vector<int32_t> prompt = tokenize(kBuiltin, "A list is a mutable sequence");
  ASSERT_GT(prompt.size(), 3u);
  GroupOptions o;
  o.model = kBuiltin;
  o.extra_args = {"--coordinator-arg=--speculate-mtp=" + std::to_string(GetParam())};
  const auto [c, last] = speculate_twice(o, prompt, 48);
  EXPECT_GT(c.mtp_used, 0u);
  EXPECT_EQ(c.mtp_none, 0u);   // the head followed every step of both requests
  EXPECT_GT(c.verify, 0u);
  EXPECT_GT(c.accepted, 0u);
  EXPECT_GT(c.drafted, c.accepted);   // a rejection: the DeltaNet snapshot restored, the head rewound
  // A DeltaNet model reuses only a whole cached sequence: the last request started from a reset.
  EXPECT_GT(last.mtp_used, 0u);
  EXPECT_EQ(last.mtp_none, 0u);
}

INSTANTIATE_TEST_SUITE_P(Builtin, GroupMtpDrafts, ::testing::Values(1, 3));

TEST(GroupMtp, AttentionOnlyModelRewindsToTheAcceptedPosition) {
  const std::string dir = testing::temp_path("group-mtp-attn");
  fs::create_directories(dir);
  const std::string path = dir + "/attn-mtp.gguf";
  testing::SyntheticSpec spec;
  spec.arch = "qwen3next";
  spec.n_layer = 2;
  spec.full_attention_interval = 1;   // every layer full attention: rewinds to any position
  spec.n_nextn = 1;
  testing::SyntheticModel(spec).write(path);
  GroupOptions o;
  o.model = path;
  const std::vector<int32_t> prompt = {5, 17, 5, 17, 5, 17, 5, 17};
  const auto [c, last] = speculate_twice(o, prompt, 24);
  EXPECT_GT(c.mtp_used, 0u);
  EXPECT_EQ(c.mtp_none, 0u);   // the second request rewound the first's cache to its prompt: followed
  EXPECT_GT(c.verify, 0u);
  EXPECT_GT(c.drafted, c.accepted);
  // The last request rewound the plain one's cache: the head had not seen it, so no MTP drafts
  // (the suffix drafter's instead), and still the reference's tokens.
  EXPECT_EQ(last.mtp_used, 0u);
  EXPECT_GT(last.mtp_none, 0u);
  EXPECT_GT(last.drafted, 0u);
  fs::remove_all(dir);
}

TEST(GroupMtp, SpeculateMtpZeroKeepsTheSuffixDrafter) {
  const std::vector<int32_t> prompt = tokenize(kBuiltin, "A list is a mutable sequence");
  GroupOptions o;
  o.model = kBuiltin;
  o.extra_args = {"--coordinator-arg=--speculate-mtp=0"};
  const auto [c, last] = speculate_twice(o, prompt, 32);
  EXPECT_EQ(c.mtp_used + last.mtp_used, 0u);
  EXPECT_EQ(c.mtp_none + last.mtp_none, 0u);
  EXPECT_GT(c.drafted, 0u);   // the suffix drafter's
}

TEST(GroupMtp, SampledRequestSpeculatesFromTheContext) {
  const std::vector<int32_t> prompt =
      tokenize(kBuiltin, "one two three four, one two three four, one two three four, one two three four");
  const int64_t V = model::Model::load(kBuiltin).hp.n_vocab;
  GroupOptions o;
  o.model = kBuiltin;
  Group g(o);
  for (const bool check : {false, true}) {
    generate::SamplingParams sp;
    sp.set_temperature(0.7f);
    sp.set_top_k(40);
    sp.set_top_p(0.95f);
    sp.set_repeat_penalty(check ? 1.1f : 1.0f);   // penalties over each row's own context
    sp.set_seed(11);
    sp.set_max_tokens(48);
    sp.set_ignore_eos(true);
    sp.set_check_logits(check);
    const Counters before = Counters::read(g.socket_dir());
    const Generation gen = generate_sampled(g.socket_dir(), prompt, sp, /*speculate=*/true);
    const Counters c = Counters::read(g.socket_dir()) - before;
    EXPECT_TRUE(gen.error.empty()) << gen.error;
    EXPECT_EQ(gen.ids.size(), 48u);
    for (const int32_t id : gen.ids) EXPECT_TRUE(id >= 0 && id < V) << id;
    EXPECT_GT(c.verify, 0u);
    EXPECT_GT(c.drafted, 0u);
    EXPECT_EQ(c.mtp_used, 0u);   // suffix drafts: the head's follow a greedy token
    std::printf("sampled speculation%s: %llu verify steps, %llu of %llu drafted tokens accepted\n",
                check ? " (repeat penalty, check_logits)" : "", static_cast<unsigned long long>(c.verify),
                static_cast<unsigned long long>(c.accepted), static_cast<unsigned long long>(c.drafted));
    // And plainly, for comparison: the same request without speculation completes too.
    const Generation plain = generate_sampled(g.socket_dir(), prompt, sp);
    EXPECT_TRUE(plain.error.empty()) << plain.error;
    EXPECT_EQ(plain.ids.size(), 48u);
  }
  g.stop();
}


// top_k 1 at a temperature: a point mass on each row's argmax (ties: the lower id, as greedy's),
// sampled on the host from every verified row's logits: the reference's greedy tokens, so the
// window's rows come back in order and each row's draft is tested against its own row. A random
// attention-only model, whose greedy output falls into loops that the suffix drafter drafts.
TEST(GroupMtp, TopKOneSampledSpeculationGivesTheGreedyTokens) {
  const std::string dir = testing::temp_path("group-spec-sampled");
  fs::create_directories(dir);
  const std::string path = dir + "/attn.gguf";
  testing::SyntheticSpec spec;
  spec.arch = "qwen3next";
  spec.n_layer = 2;
  spec.full_attention_interval = 1;
  testing::SyntheticModel(spec).write(path);
  const std::vector<int32_t> prompt = {5, 17, 5, 17, 5, 17, 5, 17};
  const int n = 64;
  const ReferenceRun ref = reference_greedy(path, prompt, n, model::KvType::F32, /*ignore_eos=*/true);
  GroupOptions o;
  o.model = path;
  Group g(o);
  generate::SamplingParams sp;
  sp.set_temperature(0.8f);
  sp.set_top_k(1);
  sp.set_seed(5);
  sp.set_max_tokens(n);
  sp.set_ignore_eos(true);
  const Counters before = Counters::read(g.socket_dir());
  const Generation gen = generate_sampled(g.socket_dir(), prompt, sp, /*speculate=*/true);
  const Counters c = Counters::read(g.socket_dir()) - before;
  EXPECT_TRUE(gen.error.empty()) << gen.error;
  EXPECT_EQ(gen.ids, ref.ids);
  EXPECT_GT(c.verify, 0u);
  EXPECT_GT(c.accepted, 0u);   // rows past the first were used
  EXPECT_GT(c.drafted, c.accepted);
  std::printf("top_k 1 sampled speculation: %llu verify steps, %llu of %llu drafted tokens accepted\n",
              static_cast<unsigned long long>(c.verify), static_cast<unsigned long long>(c.accepted),
              static_cast<unsigned long long>(c.drafted));
  g.stop();
  // Greedy with the argmax taken on the host (--greedy-on-host): windows verified by
  // Sequence::speculate's greedy rule, the same tokens.
  o.extra_args = {"--coordinator-arg=--greedy-on-host"};
  Group host(o);
  const Counters before_host = Counters::read(host.socket_dir());
  const Generation greedy = generate(host.socket_dir(), prompt, n, /*check_logits=*/true, /*speculate=*/true);
  const Counters ch = Counters::read(host.socket_dir()) - before_host;
  EXPECT_TRUE(greedy.error.empty()) << greedy.error;
  EXPECT_EQ(greedy.ids, std::vector<int32_t>(ref.ids.begin(), ref.ids.begin() + static_cast<std::ptrdiff_t>(greedy.ids.size())));
  EXPECT_EQ(greedy.ids.size(), ref.ids.size());
  EXPECT_GT(ch.verify, 0u);
  EXPECT_GT(ch.accepted, 0u);
  host.stop();
  fs::remove_all(dir);
}

}  // namespace
}  // namespace moraine::group_test
