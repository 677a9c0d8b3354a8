// Tensor and metadata mapping for the Qwen MoE families: Hugging Face Qwen3MoeForCausalLM ->
// GGUF "qwen3moe", Qwen3NextForCausalLM -> GGUF "qwen3next", with the key names, tensor names,
// shapes and value transformations llama.cpp's converter uses, so llama.cpp loads the result.
#pragma once
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "tools/convert/safetensors.h"
#include "tools/convert/tensor_plan.h"

namespace moraine::convert {

// The Hugging Face architecture names (config.json "architectures") this converter maps.
const std::vector<std::string>& supported_architectures();

// Builds the plan for a checkpoint. Every checkpoint tensor must be used (a tensor it cannot map
// is refused by name), every expected tensor must be present with the shape config.json implies,
// and config settings the GGUF architecture cannot express are refused naming the key.
ConvertPlan plan_qwen(const nlohmann::json& config, const Checkpoint& ckpt);

}  // namespace moraine::convert
