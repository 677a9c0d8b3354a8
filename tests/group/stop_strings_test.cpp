// StopMatcher (coordinator/stop_strings.h): every split of a text into pieces releases the same
// text as a direct search for the first stop string does, and never releases a byte of it.
#include <gtest/gtest.h>

#include <random>
#include <string>
#include <vector>

#include "coordinator/stop_strings.h"

namespace moraine::group {
namespace {

// The reference: the text generated a byte at a time, stopping at the first prefix that ends
// with a stop string, and cut before that stop string (the longest, where several end there).
std::pair<std::string, bool> reference(const std::string& text, const std::vector<std::string>& stops) {
  for (size_t n = 1; n <= text.size(); ++n) {
    size_t cut = std::string::npos;
    for (const std::string& s : stops)
      if (!s.empty() && s.size() <= n && text.compare(n - s.size(), s.size(), s) == 0) cut = std::min(cut, n - s.size());
    if (cut != std::string::npos) return {text.substr(0, cut), true};
  }
  return {text, false};
}

// Feeds `text` cut at random points and checks the released text after every piece.
void check_splits(const std::string& text, const std::vector<std::string>& stops, uint64_t seed) {
  std::mt19937_64 rng(seed);
  const auto [want, want_stop] = reference(text, stops);
  StopMatcher m(stops);
  std::string got;
  bool stopped = false;
  for (size_t at = 0; at < text.size() && !stopped;) {
    const size_t n = 1 + rng() % 4;
    const StopMatcher::Step s = m.push(text.substr(at, n));
    at += n;
    got += s.text;
    stopped = s.stopped;
    // Never ahead of the reference: a released byte is final.
    ASSERT_EQ(want.compare(0, got.size(), got), 0) << "released past the stop: " << got;
  }
  if (!stopped) got += m.flush();
  EXPECT_EQ(got, want) << text;
  EXPECT_EQ(stopped, want_stop) << text;
}

TEST(StopMatcher, MatchesDirectSearchForEverySplit) {
  const std::vector<std::pair<std::string, std::vector<std::string>>> cases = {
      {"Hello world. STOP here", {"STOP"}},
      {"aaab", {"aab"}},
      {"no stop in this text at all", {"xyz", "qq"}},
      {"two: END and ###", {"###", "END"}},
      {"ends with a partial ST", {"STOP"}},
      {"überstop ✓ done", {"✓"}},
      {"overlap abcabd", {"abcabd", "cab"}},   // "cab" completes first
      {"overlap abcabd", {"abcabd", "bd"}},    // both complete at once: the longer, earlier one
      {"", {"x"}},
  };
  for (const auto& [text, stops] : cases)
    for (uint64_t seed = 0; seed < 30; ++seed) check_splits(text, stops, seed);
}

TEST(StopMatcher, HoldsBackOnlyAPossibleStopPrefix) {
  StopMatcher m({"</answer>"});
  EXPECT_EQ(m.push("the answer is 4</").text, "the answer is 4");
  EXPECT_EQ(m.held_bytes(), 2u);
  const StopMatcher::Step s = m.push("b>");   // "</b>" is not the stop: released
  EXPECT_EQ(s.text, "</b>");
  EXPECT_FALSE(s.stopped);
  const StopMatcher::Step t = m.push(" ok</ans" "wer> tail");
  EXPECT_EQ(t.text, " ok");
  EXPECT_TRUE(t.stopped);
}

TEST(StopMatcher, NoStopsPassesThrough) {
  StopMatcher m({"", ""});
  EXPECT_FALSE(m.active());
  EXPECT_EQ(m.push("abc").text, "abc");
  EXPECT_EQ(m.held_bytes(), 0u);
}

}  // namespace
}  // namespace moraine::group
