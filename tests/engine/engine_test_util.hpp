// Helpers shared by the engine tests: tiny model configurations, deterministic parameter
// randomisation, parameter snapshots, running a forward/backward pass of a whole model,
// Hugging Face-layout tensor sets written by hand (independently of save_hf_weights), and
// "the exception's message" for checking that errors name what they should.
#pragma once

#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "engine/model/gpt_model.hpp"
#include "engine/model/random.hpp"
#include "engine/model/safetensors.hpp"
#include "kernels/tensor.hpp"
#include "tests/data/temp_dir.hpp"

namespace troupe::engine::test {

using troupe::engine::data::test::temp_dir;
using troupe::engine::data::test::write_file;

// vocab 11 (padded 16), context 8, 2 layers, 2 heads, width 8.
inline gpt_config tiny_config(int layers = 2) {
  gpt_config c;
  c.vocab_size = 11;
  c.padded_vocab_size = 16;
  c.context = 8;
  c.layers = layers;
  c.heads = 2;
  c.width = 8;
  return c;
}

// Runs f and returns the message of the exception of type E it throws. When it throws nothing
// or something else, returns a marker ("<no exception thrown>", "<unexpected exception: ...>")
// that no message check matches, so the calling CHECK fails and shows it.
template <class E = std::exception>
std::string error_message(const std::function<void()>& f) {
  try {
    f();
  } catch (const E& e) {
    return e.what();
  } catch (...) {
    try {
      throw;
    } catch (const std::exception& e) {
      return std::string("<unexpected exception: ") + e.what() + ">";
    } catch (...) {
      return "<unexpected non-std exception>";
    }
  }
  return "<no exception thrown>";
}

// All of a stage's parameters (flat buffer, including alignment gaps).
// Tokens and targets for the GPU model tests: B*T ids below `vocab`, every 11th target (from
// the 6th) ignored.
struct token_batch {
  std::vector<std::int32_t> inputs, targets;
};
inline token_batch gpu_test_batch(std::uint64_t salt, int B, int T, int vocab) {
  token_batch b;
  for (int i = 0; i < B * T; ++i) {
    b.inputs.push_back(static_cast<std::int32_t>(splitmix64(salt + i) % vocab));
    b.targets.push_back(i % 11 == 5
                            ? ignore_index
                            : static_cast<std::int32_t>(splitmix64(salt + 7919 + i) % vocab));
  }
  return b;
}

// max |a - b| / max |b|: how far a is from b, relative to b's largest magnitude.
inline double relative_difference(const std::vector<float>& a, const std::vector<float>& b) {
  REQUIRE(a.size() == b.size());
  double diff = 0, mag = 1e-30;
  for (std::size_t i = 0; i < a.size(); ++i) {
    diff = std::max(diff, std::abs(double(a[i]) - double(b[i])));
    mag = std::max(mag, std::abs(double(b[i])));
  }
  return diff / mag;
}

inline std::vector<float> snapshot_params(const gpt_chunk& s) {
  return std::vector<float>(s.params(), s.params() + s.parameter_count());
}
inline std::vector<float> tensor_values(const kernels::tensor& t) {
  return std::vector<float>(t.f32(), t.f32() + t.numel());
}

// Replaces every parameter with values far from GPT-2 init (so gradients are not tiny):
// weights U(-0.4, 0.4), biases U(-0.2, 0.2), layernorm weights 1 + U(-0.3, 0.3). Keyed by the
// parameter name only, so every partition gets the same values. Padded wte rows get
// `padded_value` (the loss must not depend on them).
inline void randomize_params(gpt_chunk& s, std::uint64_t seed, float padded_value = 0.25f) {
  for (const auto& p : s.parameters()) {
    std::mt19937 rng(static_cast<std::uint32_t>(splitmix64(seed ^ fnv1a64(p.name))));
    std::uniform_real_distribution<float> u(-1.0f, 1.0f);
    float* w = s.params() + p.offset;
    const bool bias = p.name.ends_with(".bias");
    const bool ln = p.name.find(".ln_") != std::string::npos;
    for (std::int64_t i = 0; i < p.numel; ++i) {
      const float r = u(rng);
      w[i] = bias ? 0.2f * r : ln ? 1.0f + 0.3f * r : 0.4f * r;
    }
    if (p.name == "transformer.wte.weight") {
      const std::int64_t real = std::int64_t{s.config().vocab_size} * s.config().width;
      for (std::int64_t i = real; i < p.numel; ++i) w[i] = padded_value;
    }
  }
}

// One micro-batch: tokens < vocab_size, targets < vocab_size or ignore_index.
struct micro_batch {
  int B = 0, T = 0;
  std::vector<std::int32_t> tokens, targets;
};

inline micro_batch make_batch(const gpt_config& c, int B, int T, std::uint32_t seed,
                              int ignore_every = 4) {
  micro_batch mb{B, T, std::vector<std::int32_t>(std::size_t(B) * T),
                 std::vector<std::int32_t>(std::size_t(B) * T)};
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int> tok(0, c.vocab_size - 1);
  for (std::size_t i = 0; i < mb.tokens.size(); ++i) {
    mb.tokens[i] = tok(rng);
    mb.targets[i] = tok(rng);
    if (ignore_every > 0 && i % std::size_t(ignore_every) == 1) mb.targets[i] = ignore_index;
  }
  return mb;
}

// Forward + mean loss of a whole-model stage (no gradients).
inline kernels::cross_entropy_result model_loss(const gpt_chunk& s, gpt_activations& acts,
                                                const micro_batch& mb) {
  chunk_forward(s, acts, mb.tokens.data(), nullptr);
  return chunk_loss(s, acts, mb.targets.data());
}

// Forward + backward of a whole-model stage, accumulating grad_scale * d(mean loss) into the
// stage's gradients. Returns the loss.
inline kernels::cross_entropy_result model_backward(const gpt_chunk& s, gpt_activations& acts,
                                                    const micro_batch& mb,
                                                    float grad_scale = 1.0f) {
  chunk_forward(s, acts, mb.tokens.data(), nullptr);
  auto r = chunk_loss_backward_start(s, acts, mb.targets.data(), grad_scale);
  chunk_backward(s, acts, nullptr, nullptr);
  return r;
}

// A tensor as it is stored in a Hugging Face file: shape and row-major f32 values.
struct hf_tensor {
  kernels::shape_t shape;
  std::vector<float> values;
};
using hf_tensors = std::map<std::string, hf_tensor>;

// The stage's parameters in Hugging Face layout, built by hand: Conv1D weights transposed to
// [in, out], wte without its padded rows. `prefix` false drops "transformer.".
inline hf_tensors hf_from_chunk(const gpt_chunk& s, bool prefix = true) {
  hf_tensors out;
  const auto& c = s.config();
  for (const auto& p : s.parameters()) {
    const float* w = s.params() + p.offset;
    hf_tensor t;
    if (p.name == "transformer.wte.weight") {
      t.shape = {c.vocab_size, c.width};
      t.values.assign(w, w + std::int64_t{c.vocab_size} * c.width);
    } else if (p.conv1d) {
      const std::int64_t rows = p.shape[0], cols = p.shape[1];  // [out, in]
      t.shape = {cols, rows};
      t.values.resize(static_cast<std::size_t>(p.numel));
      for (std::int64_t o = 0; o < rows; ++o) {
        for (std::int64_t i = 0; i < cols; ++i) {
          t.values[static_cast<std::size_t>(i * rows + o)] = w[o * cols + i];
        }
      }
    } else {
      t.shape = p.shape;
      t.values.assign(w, w + p.numel);
    }
    std::string name = p.name;
    if (!prefix) name = name.substr(std::string("transformer.").size());
    out[name] = std::move(t);
  }
  return out;
}

// Writes the tensors as F32, or as BF16 (rounded) when bf16 is set.
inline void write_hf(const std::filesystem::path& path, const hf_tensors& tensors,
                     bool bf16 = false) {
  std::map<std::string, safetensors_tensor> out;
  std::vector<std::vector<std::uint16_t>> half;  // keeps bf16 copies alive
  half.reserve(tensors.size());
  for (const auto& [name, t] : tensors) {
    if (bf16) {
      auto& h = half.emplace_back(t.values.size());
      for (std::size_t i = 0; i < h.size(); ++i) h[i] = kernels::f32_to_bf16(t.values[i]);
      out[name] = safetensors_tensor{"BF16", t.shape, h.data(), h.size() * 2};
    } else {
      out[name] = safetensors_tensor{"F32", t.shape, t.values.data(), t.values.size() * 4};
    }
  }
  write_safetensors(path, out, {{"format", "pt"}});
}

}  // namespace troupe::engine::test
