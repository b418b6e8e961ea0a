// Hugging Face GPT-2 weights in and out, as safetensors with HF tensor names and layout
// (Conv1D weights [in, out], wte [vocab, width] without padding rows).
// Invariants: a file is checked against the WHOLE model before anything is copied: a missing,
// extra or wrongly shaped tensor is refused with an error naming that tensor, and the chunk is
// left untouched. Known non-parameter buffers (attn.bias, attn.masked_bias) and a tied
// lm_head.weight equal to wte are accepted.
#pragma once

#include <filesystem>

#include "engine/model/gpt_model.hpp"
#include "engine/model/safetensors.hpp"

namespace troupe::engine {

// Loads the chunk's parameters from a Hugging Face GPT-2 safetensors file.
void load_hf_weights(gpt_chunk& chunk, const std::filesystem::path& path);

// Checks a file against the model without loading (the recipe check uses it before any work).
void check_hf_weights(const gpt_config& config, const std::filesystem::path& path);

// Writes the chunk's parameters (normally the whole model) in Hugging Face layout, atomically.
void save_hf_weights(const gpt_chunk& chunk, const std::filesystem::path& path);
// Parameter p, its values in Troupe's layout, as the tensor a Hugging Face file holds under
// p.name (Conv1D weights transposed as they are written; wte's real vocabulary rows).
safetensors_tensor hf_tensor(const gpt_config& config, const parameter_info& p,
                             const float* values);

}  // namespace troupe::engine
