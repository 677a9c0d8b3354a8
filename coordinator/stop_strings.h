// Stop strings across token boundaries: text is released only once it cannot be the start of a
// stop string, so a stream never shows part of a stop string it then ends on. The text before
// the first occurrence is released; the stop string and everything after it are not.
#pragma once
#include <string>
#include <string_view>
#include <vector>

namespace moraine::group {

// A request's stop strings: the text held back grows with the longest, the matching with all.
inline constexpr size_t kMaxStopStrings = 16;
inline constexpr size_t kMaxStopBytes = 512;
// Why `stops` are over those limits (naming the limit and the value); empty when within them.
std::string stop_limit_problem(const std::vector<std::string>& stops);

class StopMatcher {
 public:
  explicit StopMatcher(std::vector<std::string> stops);   // empty strings are ignored

  struct Step {
    std::string text;      // safe to send now
    bool stopped = false;  // a stop string occurred: text is everything before it; push no more
  };
  Step push(std::string_view piece);
  std::string flush();     // the end of the stream: what was held back (no stop string matched)
  bool active() const { return !stops_.empty(); }
  size_t held_bytes() const { return held_.size(); }

 private:
  std::vector<std::string> stops_;
  std::string held_;
};

}  // namespace moraine::group
