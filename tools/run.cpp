// moraine-run: generate from a GGUF model on the CPU reference executor. Streams text as it is
// generated (whole UTF-8 characters only); --tokens feeds ids instead of a prompt; --logits-out
// writes every fed position's logits as float32 .npy [n_positions, n_vocab] (the prompt, then
// each generated token: row i predicts token i + 1); --json prints ids and timings instead.
#include <CLI/CLI.hpp>
#include <chrono>
#include <cstdio>
#include <iostream>
#include <memory>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "common/model/model.h"
#include "common/reference/executor.h"
#include "common/reference/npy.h"
#include "common/sampling/sampler.h"
#include "common/tokenizer/chat_template.h"
#include "common/tokenizer/streaming_decoder.h"
#include "common/tokenizer/token_id_list.h"
#include "common/tokenizer/tokenizer.h"

namespace {

using Clock = std::chrono::steady_clock;

struct Options {
  std::string model;
  std::string prompt;
  std::string tokens;
  int n_predict = 32;
  moraine::sampling::SamplerParams sampling;
  std::string logits_out;
  bool json = false;
  bool chat = false;
  bool ignore_eos = false;
  int threads = 0;
};

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

int run(const Options& o) {
  const moraine::model::Model model = moraine::model::Model::load(o.model);
  std::unique_ptr<moraine::tokenizer::Tokenizer> tok;
  try {
    tok = std::make_unique<moraine::tokenizer::Tokenizer>(
        moraine::tokenizer::Tokenizer::from_gguf(model.file));
  } catch (const std::exception& e) {
    if (o.tokens.empty()) throw std::runtime_error(o.model + ": no usable tokenizer (" + e.what() + "); use --tokens");
  }

  std::vector<int32_t> prompt;
  if (!o.tokens.empty()) {
    prompt = moraine::tokenizer::parse_token_id_list(o.tokens);
  } else {
    std::string text = o.prompt;
    if (o.chat) text = moraine::tokenizer::render_qwen_chatml({{"user", o.prompt, std::nullopt}});
    prompt = tok->encode(text, /*add_special=*/true, /*parse_special=*/o.chat);
    if (prompt.empty()) throw std::invalid_argument("the prompt encodes to no tokens");
  }

  moraine::reference::ReferenceExecutor exec(model, {o.threads});
  moraine::sampling::Sampler sampler(o.sampling);
  const bool keep_logits = !o.logits_out.empty();
  const bool stream = !o.json && tok != nullptr;
  std::unique_ptr<moraine::tokenizer::StreamingDecoder> dec;
  if (stream) dec = std::make_unique<moraine::tokenizer::StreamingDecoder>(*tok, false);

  std::vector<float> all_logits;
  const auto t0 = Clock::now();
  std::vector<float> logits = exec.forward(prompt, keep_logits);
  const double prefill_s = seconds_since(t0);
  if (keep_logits) all_logits = logits;
  const int64_t V = exec.n_vocab();
  std::span<const float> last(logits.data() + logits.size() - V, V);

  std::vector<int32_t> generated;
  const auto t1 = Clock::now();
  int decode_steps = 0;
  for (int i = 0; i < o.n_predict; ++i) {
    const int32_t id = sampler.sample(last);
    generated.push_back(id);
    if (stream) {
      std::cout << dec->push(id) << std::flush;
    }
    const bool stop = !o.ignore_eos && tok && tok->is_end_of_generation(id);
    if ((stop || i + 1 == o.n_predict) && !keep_logits) break;
    const int32_t one[1] = {id};
    logits = exec.forward(one, false);
    ++decode_steps;
    if (keep_logits) all_logits.insert(all_logits.end(), logits.begin(), logits.end());
    last = std::span<const float>(logits.data(), V);
    if (stop) break;
  }
  const double decode_s = seconds_since(t1);
  const double prefill_tok_s = prefill_s > 0 ? static_cast<double>(prompt.size()) / prefill_s : 0.0;
  const double decode_tok_s = decode_s > 0 ? decode_steps / decode_s : 0.0;
  if (!o.json) {   // the timings on stderr, as llama.cpp's tools print theirs: stdout stays the text
    if (stream) std::cout << dec->flush() << std::endl;
    std::fprintf(stderr, "moraine-run: prompt %zu tokens at %.1f tok/s, %zu generated at %.1f tok/s (CPU reference executor, %d threads)\n",
                 prompt.size(), prefill_tok_s, generated.size(), decode_tok_s, static_cast<int>(exec.n_threads()));
  }

  if (keep_logits) {
    moraine::reference::write_npy_f32(o.logits_out, all_logits.data(),
                                      static_cast<int64_t>(all_logits.size()) / V, V);
  }
  if (o.json) {
    nlohmann::json j;
    j["prompt_ids"] = prompt;
    j["generated_ids"] = generated;
    if (tok) j["text"] = tok->decode(generated, false);
    j["n_prompt"] = prompt.size();
    j["n_generated"] = generated.size();
    j["prefill_s"] = prefill_s;
    j["decode_s"] = decode_s;
    j["prefill_tok_s"] = prefill_tok_s;
    j["decode_tok_s"] = decode_tok_s;
    j["threads"] = exec.n_threads();
    // replace: generated text may end inside a UTF-8 character.
    std::cout << j.dump(1, ' ', false, nlohmann::json::error_handler_t::replace) << std::endl;
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"moraine-run: generate with the CPU reference executor"};
  Options o;
  app.add_option("-m,--model", o.model, "GGUF model file")->required();
  auto* p = app.add_option("-p,--prompt", o.prompt, "prompt text");
  auto* t = app.add_option("--tokens", o.tokens, "prompt as comma-separated token ids");
  p->excludes(t);
  app.add_option("-n,--n-predict", o.n_predict, "tokens to generate")->check(CLI::NonNegativeNumber);
  app.add_option("--temp", o.sampling.temperature, "temperature (0 = greedy)");
  app.add_option("--top-k", o.sampling.top_k, "keep the k most likely tokens (0 = off)");
  app.add_option("--top-p", o.sampling.top_p, "nucleus mass (1 = off)")->check(CLI::Range(0.0, 1.0));
  app.add_option("--seed", o.sampling.seed, "sampler seed");
  app.add_option("--logits-out", o.logits_out, "write logits of every position as .npy");
  app.add_flag("--json", o.json, "print generated ids and timings as JSON");
  app.add_flag("--chat", o.chat, "wrap the prompt in the ChatML template");
  app.add_flag("--ignore-eos", o.ignore_eos, "keep generating past end-of-generation tokens");
  app.add_option("-t,--threads", o.threads, "worker threads (0 = all cores)");
  CLI11_PARSE(app, argc, argv);
  if (o.prompt.empty() && o.tokens.empty()) {
    std::cerr << "moraine-run: give a prompt (-p) or token ids (--tokens)\n";
    return 2;
  }
  try {
    return run(o);
  } catch (const std::exception& e) {
    std::cerr << "moraine-run: " << e.what() << "\n";
    return 1;
  }
}
