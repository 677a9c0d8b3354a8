#include "coordinator/stop_strings.h"

#include <algorithm>
#include <utility>

namespace moraine::group {

std::string stop_limit_problem(const std::vector<std::string>& stops) {
  if (stops.size() > kMaxStopStrings)
    return std::to_string(stops.size()) + " stop strings; at most " + std::to_string(kMaxStopStrings) + " are accepted";
  for (size_t i = 0; i < stops.size(); ++i)
    if (stops[i].size() > kMaxStopBytes)
      return "stop string " + std::to_string(i) + " has " + std::to_string(stops[i].size()) + " bytes; at most " +
             std::to_string(kMaxStopBytes) + " are accepted";
  return {};
}

StopMatcher::StopMatcher(std::vector<std::string> stops) {
  for (std::string& s : stops)
    if (!s.empty()) stops_.push_back(std::move(s));
}

StopMatcher::Step StopMatcher::push(std::string_view piece) {
  held_ += piece;
  if (stops_.empty()) return {std::exchange(held_, {}), false};
  // The stop string that completes first (the earliest end; at one end, the earliest start):
  // what generating one byte at a time would meet, however the text was split into tokens.
  size_t first = std::string::npos, end = std::string::npos;
  for (const std::string& s : stops_) {
    const size_t at = held_.find(s);
    if (at == std::string::npos) continue;
    if (at + s.size() < end || (at + s.size() == end && at < first)) {
      first = at;
      end = at + s.size();
    }
  }
  if (first != std::string::npos) {
    Step out{held_.substr(0, first), true};
    held_.clear();
    return out;
  }
  // The longest end of the held text that begins some stop string stays held. Stop strings are
  // whole UTF-8, so that end starts on a character boundary and the released text is whole too.
  size_t keep = 0;
  for (const std::string& s : stops_) {
    for (size_t n = std::min(s.size() - 1, held_.size()); n > keep; --n) {
      if (held_.compare(held_.size() - n, n, s, 0, n) == 0) {
        keep = n;
        break;
      }
    }
  }
  Step out{held_.substr(0, held_.size() - keep), false};
  held_.erase(0, held_.size() - keep);
  return out;
}

std::string StopMatcher::flush() { return std::exchange(held_, {}); }

}  // namespace moraine::group
