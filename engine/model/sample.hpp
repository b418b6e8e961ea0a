// Text generation from a whole GPT-2 on the CPU (`troupe sample`): the logits at the last
// position of a token window, and the choice of the next token from them — greedy, or a draw at
// a temperature from the top k, as nanoGPT's sample.py and llm.c's sampler do.
//
// Invariants:
//  - The logits come from chunk_forward on the whole model: no arithmetic of the model is
//    repeated here. The window is the last `context` tokens (the left is cropped).
//  - The choice of a token is a pure function of (logits, options, draw index): the uniform
//    number of draw i is keyed by (seed, i) (engine/model/random.hpp), so the same seed and prompt
//    give the same tokens whenever the logits are the same (the same weights and thread count).
//  - temperature 0 is greedy: the argmax, the lowest id among equal maxima, whatever the seed.
//  - top_k 0 keeps every id; otherwise exactly the k largest logits (ties to the lower id) can
//    be drawn.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <vector>

#include "engine/model/gpt_model.hpp"

namespace troupe::engine {

struct sampling_options {
  double temperature = 1.0;  // 0: greedy (argmax)
  int top_k = 0;             // 0: every id
  std::uint64_t seed = 1337;
};

// Throws std::invalid_argument naming the field (temperature: finite and >= 0; top_k >= 0).
void check_sampling_options(const sampling_options& o);

// The distribution a draw uses: softmax(logits / temperature) over the top_k largest logits
// (every logit when top_k is 0 or >= the count), 0 elsewhere. temperature > 0.
std::vector<double> sampling_probabilities(std::span<const float> logits, double temperature,
                                           int top_k);

// The token of draw `draw`: the argmax for temperature 0, else a draw from
// sampling_probabilities with the uniform number keyed by (o.seed, draw).
std::int32_t sample_token(std::span<const float> logits, const sampling_options& o,
                          std::int64_t draw);

// The logits at the last position of a token window, from a whole model.
class next_token_logits {
 public:
  // Throws std::invalid_argument unless the stage is the whole model (both ends, every layer,
  // no tensor shards).
  explicit next_token_logits(const gpt_chunk& model);
  // window: 1 to context token ids, each < vocab_size. Returns the vocab_size logits of its last
  // position (padded vocabulary rows left out), valid until the next call.
  std::span<const float> operator()(std::span<const std::int32_t> window);

 private:
  const gpt_chunk& model_;
  std::vector<std::int32_t> tokens_;       // the forward pass reads them
  std::unique_ptr<gpt_activations> acts_;  // kept while the window's length stays the same
};

// Appends `new_tokens` tokens to the prompt (one token or more), each chosen by sample_token
// (draw i for the i-th new token) among the ids below vocab_limit (0: the model's vocab_size)
// from the logits of the last `context` tokens. on_token (if set) sees each as it is chosen.
// Returns the new tokens.
std::vector<std::int32_t> generate(const gpt_chunk& model, std::span<const std::int32_t> prompt,
                                   int new_tokens, const sampling_options& o, int vocab_limit = 0,
                                   const std::function<void(std::int32_t)>& on_token = {});

// The same with the logits from elsewhere (a GPU: gpu_trainer::last_logits): logits_of gives
// the vocab_size logits at the last position of a window of 1 to `context` tokens.
using logits_function = std::function<std::vector<float>(std::span<const std::int32_t> window)>;
std::vector<std::int32_t> generate(const logits_function& logits_of, int context, int vocab_size,
                                   std::span<const std::int32_t> prompt, int new_tokens,
                                   const sampling_options& o, int vocab_limit = 0,
                                   const std::function<void(std::int32_t)>& on_token = {});

}  // namespace troupe::engine
