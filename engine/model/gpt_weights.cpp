// Hugging Face GPT-2 safetensors import/export. See gpt_weights.hpp.
#include "engine/model/gpt_weights.hpp"

#include <cstring>
#include <map>
#include <stdexcept>

#include "engine/model/safetensors.hpp"

namespace troupe::engine {
namespace {

// The shape a parameter has in a Hugging Face file.
kernels::shape_t hf_shape(const gpt_config& c, const parameter_info& p) {
  if (p.name == "transformer.wte.weight") return {c.vocab_size, c.width};
  if (p.conv1d) return {p.shape[1], p.shape[0]};
  return p.shape;
}

bool is_ignored_buffer(const std::string& name) {
  return name.ends_with(".attn.bias") || name.ends_with(".attn.masked_bias");
}

// Maps each file tensor name to the Troupe ("transformer."-prefixed) name.
std::string canonical_name(const std::string& name) {
  if (name.starts_with("transformer.") || name == "lm_head.weight") return name;
  return "transformer." + name;
}

std::runtime_error weights_error(const std::filesystem::path& path, const std::string& what) {
  return std::runtime_error(path.string() + ": " + what);
}

// Validates the file against the whole model; returns canonical name -> file name.
std::map<std::string, std::string> check_file(const gpt_config& config,
                                              const safetensors_file& file) {
  std::map<std::string, std::string> names;
  for (const auto& [name, entry] : file.entries()) {
    if (is_ignored_buffer(name)) continue;
    const std::string canon = canonical_name(name);
    if (!names.emplace(canon, name).second) {
      throw weights_error(file.path(),
                          "tensor " + name + " appears twice (with and without prefix)");
    }
  }
  const auto whole = chunk_parameter_layout(config, chunk_range::whole(config));
  for (const auto& p : whole) {
    auto it = names.find(p.name);
    if (it == names.end()) throw weights_error(file.path(), "missing tensor " + p.name);
    const auto& entry = file.at(it->second);
    const auto want = hf_shape(config, p);
    if (entry.shape != want) {
      throw weights_error(file.path(), "tensor " + it->second + " has shape " +
                                           kernels::shape_string(entry.shape) + ", expected " +
                                           kernels::shape_string(want));
    }
    if (entry.dtype != "F32" && entry.dtype != "BF16" && entry.dtype != "F16") {
      throw weights_error(file.path(), "tensor " + it->second + " has dtype " + entry.dtype +
                                           ", expected F32, BF16 or F16");
    }
  }
  for (const auto& [canon, name] : names) {
    if (canon == "lm_head.weight") continue;  // checked below
    bool known = false;
    for (const auto& p : whole) known = known || p.name == canon;
    if (!known) throw weights_error(file.path(), "unexpected tensor " + name + " for this model");
  }
  return names;
}

}  // namespace

void check_hf_weights(const gpt_config& config, const std::filesystem::path& path) {
  const safetensors_file file(path);
  check_file(config, file);
}

void load_hf_weights(gpt_chunk& chunk, const std::filesystem::path& path) {
  const safetensors_file file(path);
  const gpt_config& c = chunk.config();
  const auto names = check_file(c, file);
  if (auto head = names.find("lm_head.weight"); head != names.end()) {
    const kernels::tensor lm = file.read_f32(head->second);
    const kernels::tensor wte = file.read_f32(names.at("transformer.wte.weight"));
    if (lm.shape() != wte.shape() || std::memcmp(lm.data(), wte.data(), wte.nbytes()) != 0) {
      throw weights_error(path,
                          "tensor lm_head.weight differs from transformer.wte.weight: "
                          "untied heads are not supported");
    }
  }
  // Read everything first, then copy: a failure leaves the chunk untouched.
  std::vector<std::pair<const parameter_info*, kernels::tensor>> loaded;
  for (const auto& p : chunk.parameters()) loaded.emplace_back(&p, file.read_f32(names.at(p.name)));
  std::vector<float> whole;  // a tensor shard's whole tensor, before its slice is taken
  for (auto& [p, t] : loaded) {
    const bool sliced = p->split != tensor_split::replicated;
    if (sliced) whole.assign(static_cast<std::size_t>(kernels::shape_numel(p->full_shape)), 0.0f);
    float* dst = sliced ? whole.data() : chunk.params() + p->offset;
    const float* src = t.f32();
    const std::int64_t numel = kernels::shape_numel(p->full_shape);
    if (p->conv1d) {  // [in, out] -> [out, in]
      kernels::transpose_2d(dst, src, p->full_shape[1], p->full_shape[0]);
    } else {
      std::memcpy(dst, src, t.nbytes());
      std::fill(dst + t.numel(), dst + numel, 0.0f);  // padded vocabulary rows
    }
    if (sliced) take_shard(*p, chunk.shard(), whole.data(), chunk.params() + p->offset);
  }
}

safetensors_tensor hf_tensor(const gpt_config& config, const parameter_info& p,
                             const float* values) {
  const auto shape = hf_shape(config, p);
  return safetensors_tensor{"F32", shape, values,
                            static_cast<std::size_t>(kernels::shape_numel(shape)) * 4,
                            p.conv1d ? p.shape[0] : 0};
}

void save_hf_weights(const gpt_chunk& chunk, const std::filesystem::path& path) {
  std::map<std::string, safetensors_tensor> out;
  for (const auto& p : chunk.parameters())
    out[p.name] = hf_tensor(chunk.config(), p, chunk.params() + p.offset);
  write_safetensors(path, out, {{"format", "pt"}});
}

}  // namespace troupe::engine
