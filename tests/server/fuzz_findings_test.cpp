// What the libFuzzer targets found (tests/fuzz), each replayed as a plain test so that it stays
// fixed without a clang build: the input that failed and what must happen instead.
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "common/jinja/template.h"
#include "coordinator/census.h"
#include "coordinator/group_layout.h"
#include "coordinator/placement.h"
#include "server/chat_output.h"
#include "server/openai_api.h"

namespace moraine::server {
namespace {

using nlohmann::json;

// http_request_fuzz: generated text that is not UTF-8 (a model's byte tokens) made the whole
// response of a tool-call-format request throw json type_error 316 (a strict dump()); the
// server's own serialisation replaces such bytes, so must this.
TEST(FuzzFindings, ResponseWithInvalidUtf8TextInEveryFormat) {
  ApiRequest r = parse_request(R"({"messages": [{"role": "user", "content": "hi"}]})", Endpoint::kChat, {"m"});
  const std::string text = "<|channel|>final<|message|>ok \xfc\x80 <tool_call>{\"name\": \"f\xfc\"}</tool_call> \xc3";
  for (chat::ToolCallFormat f : {chat::ToolCallFormat::kNone, chat::ToolCallFormat::kQwen, chat::ToolCallFormat::kHarmony}) {
    r.output.format = f;
    Generated g;
    g.text = text;
    g.finish = generate::FINISH_STOP;
    json j;
    ASSERT_NO_THROW(j = response_json(r, "id", 1, g)) << "format " << static_cast<int>(f);
    const std::string out = j.dump(-1, ' ', false, json::error_handler_t::replace);
    EXPECT_NE(out.find("ok"), std::string::npos) << out;
    ChunkStream stream(r, "id", 1);
    for (char c : text) ASSERT_NO_THROW((void)stream.chunk(std::string(1, c), {}, generate::FINISH_REASON_UNSPECIFIED));
    ASSERT_NO_THROW((void)stream.chunk("", {}, generate::FINISH_STOP));
  }
}

// http_request_fuzz: nlohmann's reader takes a NUL byte for the end of input, so a body with
// anything after one was accepted as the JSON before it.
TEST(FuzzFindings, BodyWithANulByteIsRefused) {
  const std::string body = std::string(R"({"messages": [{"role": "user", "content": "hi"}]})") + '\0' + "{\"junk\": [";
  try {
    (void)parse_request(body, Endpoint::kChat, {"m"});
    FAIL() << "accepted";
  } catch (const ApiError& e) {
    EXPECT_EQ(e.status, 400);
    EXPECT_NE(std::string(e.what()).find("NUL byte at offset 49"), std::string::npos) << e.what();
  }
  EXPECT_THROW((void)parse_request(std::string("{}\0", 3), Endpoint::kCompletions, {"m"}), ApiError);
}

// http_request_fuzz (in CI): a float integer field beyond int64 ("max_tokens": 1.66e47) was cast
// to int64 before its range check (undefined behaviour; x86 gives INT64_MIN, so the refusal named
// -9223372036854775808). Now the float is checked first and the refusal names it.
TEST(FuzzFindings, HugeFloatIntegerFieldIsRefusedByItsValue) {
  const std::string body = R"({"model": "m", "prompt": "x", "max_tokens": 165555555555555555555555555555555555555555555555})";
  try {
    (void)parse_request(body, Endpoint::kCompletions, {"m"});
    FAIL() << "accepted";
  } catch (const ApiError& e) {
    EXPECT_EQ(e.status, 400);
    const std::string what = e.what();
    EXPECT_NE(what.find("max_tokens"), std::string::npos) << what;
    EXPECT_NE(what.find("1.6555"), std::string::npos) << what;
  }
}

// The error a reader gives for FILE_TEXT written to a temp file ("" when it reads it).
template <class Read>
std::string read_error(const std::string& file_text, Read read) {
  const std::string path = (std::filesystem::temp_directory_path() / ("fuzz-finding-" + std::to_string(::getpid()) + ".json")).string();
  { std::ofstream(path) << file_text; }
  std::string error;
  try {
    read(path);
  } catch (const std::runtime_error& e) {
    error = e.what();
    EXPECT_NE(error.find(path), std::string::npos) << error;
  }
  std::filesystem::remove(path);
  return error;
}

// config_fuzz: a float beyond the integer's range ("vram_budget": 1.9e19) was converted with
// nlohmann's get<uint64_t>() (undefined behaviour, UBSan's float-cast-overflow); an integer
// too large for an int field wrapped. Each is now an error naming the key.
TEST(FuzzFindings, PlacementPlanNumbersAreCheckedIntegers) {
  group::ModelSizes s;
  s.n_layer = 1;
  s.n_expert = 2;
  s.n_expert_used = 1;
  s.expert_bytes.assign(1, 4096);
  s.expert_slot_bytes.assign(1, 4096);
  const auto plan = [](const std::string& vram, const std::string& workers) {
    return R"({"version": 1, "n_layer": 1, "n_expert": 2, "n_cpu_workers": )" + workers +
           R"(, "staging_slots": 0, "staging_slot_bytes": 0, "vram_budget": )" + vram +
           R"(, "ram_budget": 0, "dense_bytes": 0, "kv_bytes": 0, "context": 16, "tiers": ["RR"]})";
  };
  const auto read = [&](const std::string& p) { (void)group::PlacementPlan::read(p, s); };
  EXPECT_EQ(read_error(plan("18446744073709551615", "1"), read), "");
  EXPECT_NE(read_error(plan("1.9e19", "1"), read).find("vram_budget = 1.9e+19 is not an integer"), std::string::npos);
  EXPECT_NE(read_error(plan("-1", "1"), read).find("vram_budget = -1 is out of range"), std::string::npos);
  EXPECT_NE(read_error(plan("0", "4294967297"), read).find("n_cpu_workers = 4294967297 is out of range"), std::string::npos);
}

TEST(FuzzFindings, ManifestAndCensusNumbersAreCheckedIntegers) {
  const std::string manifest = R"({"model_path": "m", "group_prefix": "g", "exchange_locator": "e", "arena_locator": "a",
    "coordinator_pid": 1e30, "coordinator_start_ticks": 1, "n_cpu_workers": 1, "max_tokens": 8, "zmq_handoff": false,
    "placement_path": "p", "census_path": "c"})";
  EXPECT_NE(read_error(manifest, [](const std::string& p) { (void)group::GroupManifest::read(p); }).find("coordinator_pid = 1e+30 is not an integer"),
            std::string::npos);
  EXPECT_NE(read_error(R"({"n_layer": 1e300, "n_expert": 2, "counts": [[1, 2]]})",
                       [](const std::string& p) { (void)group::Census::read(p, 1, 2); })
                .find("n_layer = 1e+300 is not an integer"),
            std::string::npos);
}

std::string render_error(const std::string& source) {
  try {
    (void)jinja::Template(source).render(nlohmann::ordered_json::object());
  } catch (const jinja::TemplateError& e) {
    return e.what();
  }
  return "";
}

// chat_template_fuzz, on a hand-written input (its mutations had not reached it in 60 s): a (model
// file's) template that doubles a string in a loop took 2.4 GB in
// milliseconds (ASan's limit was 2 GB); repetition and range() were bounded, concatenation and
// the output were not. Now strings and the output stop at 2^28 bytes, lists at 1,000,000 items
// (list repetition allowed 2^28, 21 GB of Values), with an error naming the line.
TEST(FuzzFindings, TemplateStringsAndOutputAreBounded) {
  EXPECT_NE(render_error("{% set ns = namespace(s='ab') %}\n{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}")
                .find("string concatenation of more than 2^28 bytes"),
            std::string::npos);
  EXPECT_NE(render_error("{% set ns = namespace(s=[1]) %}{% for i in range(40) %}{% set ns.s = ns.s + ns.s %}{% endfor %}")
                .find("list concatenation of more than 1,000,000 items"),
            std::string::npos);
  const std::string out = render_error("{% for i in range(1000000) %}\n{{ 'x' * 1000 }}{% endfor %}");
  EXPECT_NE(out.find("rendered output of more than 2^28 bytes"), std::string::npos) << out;
  EXPECT_NE(out.find("line 2"), std::string::npos) << out;
  EXPECT_NE(render_error("{{ ([1] * 1000001) | length }}").find("list repetition of more than 1,000,000 items"), std::string::npos);
  EXPECT_EQ(render_error("{% set ns = namespace(s='ab') %}{% for i in range(20) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}"), "");
  EXPECT_EQ(render_error("{{ ([1] * 1000000) | length }}"), "");
}

// Found reading range() for the bound above: i += step overflowed int64 (undefined behaviour)
// when the last item was within step of INT64's end.
TEST(FuzzFindings, RangeNearInt64EndStops) {
  EXPECT_EQ(jinja::Template("{{ range(1, 9223372036854775807, 9223372036854775807) | list }}").render(nlohmann::ordered_json::object()),
            "[1]");
  EXPECT_EQ(jinja::Template("{{ range(-2, -9223372036854775807 - 1, -9223372036854775807) | list }}").render(nlohmann::ordered_json::object()),
            "[-2]");
}

}  // namespace
}  // namespace moraine::server
