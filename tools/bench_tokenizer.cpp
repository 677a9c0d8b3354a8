// moraine-tokenizer-bench: encode throughput (MB/s, one thread) on 1 MB of deterministic mixed
// text: English prose, C++/Python code, Chinese and Japanese, emoji (ZWJ sequences too), numbers.
#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <ctime>
#include <fstream>
#include <iterator>
#include <random>
#include <string>
#include <vector>

#include "common/tokenizer/tokenizer.h"

namespace {

// Text of `bytes` bytes (cut at a character boundary) drawn from fixed pools with a fixed seed,
// so every run and every machine measures the same input.
std::string mixed_text(size_t bytes, uint32_t seed) {
  static const std::vector<std::string> words = {
      "the", "of", "and", "a", "to", "in", "is", "you", "that", "it", "he", "was", "for", "on",
      "are", "as", "with", "his", "they", "I", "at", "be", "this", "have", "from", "or", "one",
      "had", "by", "word", "but", "not", "what", "all", "were", "we", "when", "your", "can",
      "said", "there", "use", "an", "each", "which", "she", "do", "how", "their", "if", "will",
      "up", "other", "about", "out", "many", "then", "them", "these", "so", "some", "her",
      "would", "make", "like", "him", "into", "time", "has", "look", "two", "more", "write",
      "go", "see", "number", "no", "way", "could", "people", "my", "than", "first", "water",
      "been", "call", "who", "oil", "its", "now", "find", "long", "down", "day", "did", "get",
      "come", "made", "may", "part", "tokenizer", "inference", "mixture", "experts",
      "throughput", "latency", "don't", "it's", "we'll", "they've", "Hello", "World", "CUDA"};
  static const std::vector<std::string> code = {
      "for (int i = 0; i < n; ++i) {\n    sum += a[i] * b[i];\n}\n",
      "def forward(self, x):\n    return self.proj(torch.relu(x)) + x\n",
      "    if (ptr == nullptr) return -EINVAL;\n",
      "std::vector<std::pair<int, float>> scores;\n",
      "\tconst auto it = map.find(key);\n\tif (it != map.end()) { return it->second; }\n",
      "SELECT id, name FROM users WHERE age >= 21 ORDER BY name;\n",
      "{\"model\": \"qwen3\", \"temperature\": 0.7, \"max_tokens\": 256}\n"};
  static const std::vector<std::string> cjk = {
      "我们今天在实验室里测试新的推理引擎。", "这个模型的专家混合结构非常有效。",
      "東京は日本の首都です。", "トークナイザーの速度を測定します。", "한국어 문장도 포함합니다. "};
  static const std::vector<std::string> emoji = {
      "😀", "🚀", "👍🏽", "👨‍👩‍👧‍👦", "🏳️‍🌈", "❤️", "🦙", "✅", "🇯🇵", "😶‍🌫️"};
  std::mt19937 rng(seed);
  const auto pick = [&](const std::vector<std::string>& pool) -> const std::string& {
    return pool[std::uniform_int_distribution<size_t>(0, pool.size() - 1)(rng)];
  };
  std::string out;
  out.reserve(bytes + 256);
  while (out.size() < bytes) {
    const int kind = std::uniform_int_distribution<int>(0, 99)(rng);
    if (kind < 60) {  // a sentence of prose
      const int n = std::uniform_int_distribution<int>(5, 20)(rng);
      for (int k = 0; k < n; ++k) out += (k ? " " : "") + pick(words);
      out += std::uniform_int_distribution<int>(0, 3)(rng) == 0 ? ".\n" : ". ";
    } else if (kind < 78) {
      out += pick(code);
    } else if (kind < 88) {
      out += pick(cjk);
    } else if (kind < 94) {
      out += pick(emoji) + " ";
    } else {  // numbers
      out += std::to_string(std::uniform_int_distribution<uint64_t>(0, 1'000'000'000)(rng)) + ", " +
             std::to_string(std::uniform_real_distribution<double>(-1000, 1000)(rng)) + " ";
    }
  }
  size_t cut = bytes;
  while (cut > 0 && (static_cast<uint8_t>(out[cut]) & 0xC0) == 0x80) --cut;
  out.resize(cut);
  return out;
}

double thread_cpu_seconds() {
  timespec ts{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + static_cast<double>(ts.tv_nsec) * 1e-9;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Tokenizer encode throughput on 1 MB of mixed text, one thread."};
  std::string model;
  size_t bytes = 1 << 20;
  int repeats = 5;
  std::string file;
  app.add_option("-m,--model", model, "GGUF file with a tokenizer")->required();
  app.add_option("--bytes", bytes, "size of the generated text")->check(CLI::PositiveNumber);
  app.add_option("--repeats", repeats, "timed runs; medians are reported")->check(CLI::PositiveNumber);
  app.add_option("--file", file, "measure this file's first --bytes instead of generated text")
      ->check(CLI::ExistingFile);
  CLI11_PARSE(app, argc, argv);

  try {
    const auto tok = moraine::tokenizer::Tokenizer::from_gguf_path(model);
    std::string text;
    if (file.empty()) {
      text = mixed_text(bytes, 20260101);
    } else {
      std::ifstream in(file, std::ios::binary);
      text.assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
      if (text.size() > bytes) text.resize(bytes);
    }
    // Wall time and this thread's CPU time: on a shared machine the CPU time is the steadier
    // measure of what one core does.
    std::vector<double> wall, cpu;
    size_t n_tokens = 0;
    for (int r = 0; r < repeats; ++r) {
      const double c0 = thread_cpu_seconds();
      const auto t0 = std::chrono::steady_clock::now();
      const auto ids = tok.encode(text, false, true);
      const auto t1 = std::chrono::steady_clock::now();
      cpu.push_back(thread_cpu_seconds() - c0);
      n_tokens = ids.size();
      wall.push_back(std::chrono::duration<double>(t1 - t0).count());
    }
    std::sort(wall.begin(), wall.end());
    std::sort(cpu.begin(), cpu.end());
    const double wall_median = wall[wall.size() / 2], cpu_median = cpu[cpu.size() / 2];
    std::printf("model=%s pre=%s bytes=%zu tokens=%zu  wall median %.2f ms (%.1f MB/s)  "
                "cpu median %.2f ms (%.1f MB/s)\n",
                model.c_str(), tok.pre_tokenizer_scheme().c_str(), text.size(), n_tokens,
                wall_median * 1e3, text.size() / wall_median / 1e6, cpu_median * 1e3,
                text.size() / cpu_median / 1e6);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "moraine-tokenizer-bench: error: %s\n", e.what());
    return 1;
  }
  return 0;
}
