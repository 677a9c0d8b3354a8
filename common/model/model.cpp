#include "common/model/model.h"

#include <utility>

#include "common/model/model_error.h"

namespace moraine::model {

Model Model::load(const std::string& path) { return bind(gguf::GgufFile::open(path)); }

Model Model::bind(gguf::GgufFile file) {
  Model m{std::move(file), {}, {}, {}, {}, {}, {}};
  m.hp = read_hparams(m.file);
  const gguf::TensorInfo* embd = m.file.find_tensor("token_embd.weight");
  const std::string where = m.file.paths().empty() ? std::string("model") : m.file.paths()[0];
  if (embd == nullptr) throw ModelError(where + ": tensor token_embd.weight is missing");
  if (embd->shape.size() != 2 || embd->shape[0] != m.hp.n_embd) {
    throw ModelError(where + ": tensor token_embd.weight has shape " + shape_string(embd->shape) +
                     ", expected [" + std::to_string(m.hp.n_embd) + ", n_vocab]");
  }
  m.hp.n_vocab = embd->shape[1];

  TensorBinder b(m.file);
  m.tok_embd = b.matrix("token_embd.weight", m.hp.n_embd, m.hp.n_vocab);
  m.output_norm = b.vector("output_norm.weight", m.hp.n_embd);
  m.output = b.has("output.weight") ? b.matrix("output.weight", m.hp.n_embd, m.hp.n_vocab)
                                    : m.tok_embd;
  switch (m.hp.arch) {
    case Arch::Qwen3Moe: bind_qwen3moe(m, b); break;
    case Arch::Qwen3Next: bind_qwen3next(m, b); break;
  }
  b.check_all_bound();
  return m;
}

}  // namespace moraine::model
