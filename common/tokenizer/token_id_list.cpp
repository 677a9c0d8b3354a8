#include "common/tokenizer/token_id_list.h"

#include <cstdint>
#include <limits>
#include <sstream>
#include <stdexcept>

namespace moraine::tokenizer {

std::vector<TokenId> parse_token_id_list(const std::string& csv, const std::string& what) {
  std::vector<TokenId> ids;
  std::stringstream ss(csv);
  std::string item;
  while (std::getline(ss, item, ',')) {
    size_t used = 0;
    long long v = -1;
    try {
      v = std::stoll(item, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    if (used == 0 || used != item.size() || v < 0 || v > std::numeric_limits<TokenId>::max()) {
      throw std::invalid_argument(what + ": '" + item + "' is not a token id");
    }
    ids.push_back(static_cast<TokenId>(v));
  }
  if (ids.empty()) throw std::invalid_argument(what + ": no ids given");
  return ids;
}

}  // namespace moraine::tokenizer
