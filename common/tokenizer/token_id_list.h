// Token ids typed by a user on a command line: "1,2,3".
#pragma once
#include <string>
#include <vector>

#include "common/tokenizer/vocab.h"

namespace moraine::tokenizer {

// Parses comma-separated non-negative token ids. Throws std::invalid_argument naming the first
// item that is not an id (what = `what`, e.g. "--tokens"), or when the list is empty.
std::vector<TokenId> parse_token_id_list(const std::string& csv, const std::string& what = "--tokens");

}  // namespace moraine::tokenizer
