// The tensors a model's recipes imply, named by its description's tensor table, with the shapes
// the hyper-parameters give them, in the order llama.cpp's converter writes them. The binder
// binds exactly these (plus the legacy alternatives it accepts), moraine-synth writes exactly
// these: one list, so a file synth writes is one the loader binds.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "common/model/arch/arch.h"
#include "common/model/hparams.h"

namespace moraine::model {

struct TensorSlot {
  TensorRole role;
  std::string name;             // GGUF name
  std::vector<int64_t> shape;   // ggml order
  int64_t layer = -1;           // -1: outside the blocks
  bool optional = false;        // the binder takes it when present (synth leaves it out)
};

// Layer il's tensors (il >= hp.n_layer: a nextn block, its projections included).
std::vector<TensorSlot> layer_tensors(const HParams& hp, int64_t il);
// token_embd, every layer, output_norm, output (optional: tied to token_embd when absent).
std::vector<TensorSlot> model_tensors(const HParams& hp);

}  // namespace moraine::model
