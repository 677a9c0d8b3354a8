#include "common/model/model.h"

#include <utility>

#include "common/model/model_error.h"

namespace moraine::model {

Model Model::load(const std::string& path) { return bind(gguf::GgufFile::open(path)); }

Model Model::bind(gguf::GgufFile file) {
  Model m{std::move(file), {}, {}, {}, {}, {}, {}};
  m.hp = read_hparams(m.file);
  const std::string where = m.file.paths().empty() ? std::string("model") : m.file.paths()[0];
  const std::string embd_name = m.hp.desc->gguf_name(TensorRole::TokEmbd, -1);
  const gguf::TensorInfo* embd = m.file.find_tensor(embd_name);
  if (embd == nullptr) throw ModelError(where + ": tensor " + embd_name + " is missing");
  if (embd->shape.size() != 2 || embd->shape[0] != m.hp.n_embd) {
    throw ModelError(where + ": tensor " + embd_name + " has shape " + shape_string(embd->shape) +
                     ", expected [" + std::to_string(m.hp.n_embd) + ", n_vocab]");
  }
  m.hp.n_vocab = embd->shape[1];

  TensorBinder b(m.file);
  const std::string output_name = m.hp.desc->gguf_name(TensorRole::Output, -1);
  m.tok_embd = b.matrix(embd_name, m.hp.n_embd, m.hp.n_vocab);
  m.output_norm = b.vector(m.hp.desc->gguf_name(TensorRole::OutputNorm, -1), m.hp.n_embd);
  m.output = b.has(output_name) ? b.matrix(output_name, m.hp.n_embd, m.hp.n_vocab) : m.tok_embd;
  bind_layers(m, b);
  b.check_all_bound();
  return m;
}

}  // namespace moraine::model
