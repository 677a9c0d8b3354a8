// The converter's side of an architecture: one file per architecture in tools/convert/arch/
// (registered by the build, as common/model/arch/ is), holding what the description cannot
// say: how config.json maps to its hyper-parameters and GGUF keys, and the hooks for the
// tensors its table does not map one to one (fused, split, reordered). Everything else - which
// tensors a layer has, their GGUF names and shapes, their Hugging Face names - the planner takes
// from the architecture description (common/model/arch/<arch>.cpp) and its recipes.
#pragma once
#include <cstdint>
#include <functional>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <vector>

#include "common/model/arch/arch.h"
#include "common/model/hparams.h"
#include "common/model/layer_tensors.h"
#include "tools/convert/hf_config.h"
#include "tools/convert/safetensors.h"
#include "tools/convert/tensor_plan.h"

namespace moraine::convert {

// What config.json (and the checkpoint's layout) say, as the written file will state it.
struct HfModel {
  model::HParams hp;                     // desc set; the recipes come from the description
  std::optional<int64_t> ctx;            // max_position_embeddings
  std::optional<int64_t> n_ff;           // intermediate_size
  std::optional<int64_t> head_dim_cfg;   // head_dim, when config.json states it
  bool tied = false;                     // tie_word_embeddings
  std::string mtp_prefix;                // where multi-token-prediction blocks live ("" none)
  int64_t mtp_first = 0;                 // the index of the first of them under mtp_prefix + "layers."
  std::vector<std::string> drop_prefixes;  // checkpoint tensors under these are not written
  model::KeyList keys;                   // the architecture's own keys, after the common ones
  std::vector<std::string> notes;        // what the GGUF cannot carry over exactly

  // "{arch}.<suffix>" into keys, in write order.
  void put(const std::string& suffix, gguf::Value v) { keys.emplace_back(std::string(hp.desc->name) + "." + suffix, std::move(v)); }
  void put_u32(const std::string& suffix, int64_t v) { put(suffix, gguf::Value::u32(static_cast<uint32_t>(v))); }
  void put_f32(const std::string& suffix, double v) { put(suffix, gguf::Value::f32(static_cast<float>(v))); }
};

class Planner;

struct ArchConverter {
  const char* arch;                      // the description's general.architecture
  std::vector<std::string> model_types;  // config.json model_type, when "architectures" is absent
  // The architecture's own settings into m.hp and its own GGUF keys into m.keys (the common
  // ones are read already), refusing, by key, what the GGUF architecture cannot express.
  void (*read_config)(const HfConfig& cfg, const Checkpoint& ckpt, HfModel& m);
  // A tensor the table does not map one to one: plans it (or nothing, when another slot's hook
  // wrote it) and returns true; false leaves it to the table. nullptr: no such tensors.
  bool (*map_tensor)(Planner& p, const model::TensorSlot& slot, const std::string& hf_prefix);
  // The element transformation of a tensor the table maps; nullptr: none.
  ElemOp (*elem_op)(model::TensorRole role);
};

// Builds the plan: the checkpoint's tensors for every slot of the description's recipes.
class Planner {
 public:
  Planner(const ArchConverter& conv, const HfModel& m, const Checkpoint& c, ConvertPlan& plan);
  void run();

  const HfModel& model() const { return m_; }
  const model::ArchDesc& desc() const { return *m_.hp.desc; }

  // The checkpoint tensor `name`, which must have `shape` (float dtypes only, unless U8 is
  // asked for); it counts as used.
  const StTensor& take(const std::string& name, const std::vector<int64_t>& shape, bool u8 = false);
  bool has(const std::string& name) const { return ckpt_.find(name) != nullptr; }
  void ignore(const std::string& name);

  // One output tensor of the given source rows; col_perm (when given) reorders every row: element i
  // is element col_perm[i] of its source row.
  void add(const std::string& name, std::vector<int64_t> shape, std::vector<RowSpan> rows, ElemOp op,
           std::vector<int64_t> col_perm = {});
  // One output tensor in a block format, filled by bytes (n_rows * row_bytes(type, shape[0])).
  void add_raw(const std::string& name, std::vector<int64_t> shape, TensorType type,
               std::function<void(uint8_t*)> fill);
  // One output tensor that is the whole of one source tensor.
  void whole(const std::string& gguf_name, std::vector<int64_t> gguf_shape, const std::string& hf_name,
             std::vector<int64_t> hf_shape, ElemOp op = ElemOp::None);
  // The table's Hugging Face name of role after prefix ("{M}..." ones: after the MTP prefix).
  std::string hf_name(model::TensorRole r, const std::string& prefix) const;

 private:
  void slot(const model::TensorSlot& t, const std::string& hf_prefix);
  void experts(const model::TensorSlot& gate, const std::string& hf_prefix);
  ElemOp op(model::TensorRole r) const { return conv_.elem_op ? conv_.elem_op(r) : ElemOp::None; }

  const ArchConverter& conv_;
  const HfModel& m_;
  const Checkpoint& ckpt_;
  ConvertPlan& plan_;
  std::set<std::string> used_;
};

// The registry: every tools/convert/arch/*.cpp, by the description's name.
const std::vector<const ArchConverter*>& all_converters();
const ArchConverter* find_converter(std::string_view arch);

// Builds the plan for a checkpoint. Every checkpoint tensor must be used (a tensor it cannot map
// is refused by name), every expected tensor must be present with the shape config.json implies,
// and config settings the GGUF architecture cannot express are refused naming the key.
ConvertPlan plan_checkpoint(const nlohmann::json& config, const Checkpoint& ckpt);

std::string shape_str(const std::vector<int64_t>& s);  // "[2, 3]"

}  // namespace moraine::convert
