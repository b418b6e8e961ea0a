// Next-token logits and sampling. See sample.hpp.
#include "engine/model/sample.hpp"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <stdexcept>
#include <string>

#include "engine/model/random.hpp"

namespace troupe::engine {

void check_sampling_options(const sampling_options& o) {
  if (!std::isfinite(o.temperature) || o.temperature < 0)
    throw std::invalid_argument("temperature: must be a finite number >= 0, got " +
                                std::to_string(o.temperature));
  if (o.top_k < 0)
    throw std::invalid_argument("top_k: must be >= 0 (0 keeps every token), got " +
                                std::to_string(o.top_k));
}

std::vector<double> sampling_probabilities(std::span<const float> logits, double temperature,
                                           int top_k) {
  if (logits.empty()) throw std::invalid_argument("sampling_probabilities: no logits");
  if (!(temperature > 0) || !std::isfinite(temperature))
    throw std::invalid_argument("sampling_probabilities: temperature must be finite and > 0");
  const auto n = logits.size();
  // The ids that may be drawn: the k largest logits, ties to the lower id.
  std::vector<std::size_t> ids(n);
  std::iota(ids.begin(), ids.end(), std::size_t{0});
  std::size_t keep = n;
  if (top_k > 0 && static_cast<std::size_t>(top_k) < n) {
    keep = static_cast<std::size_t>(top_k);
    std::partial_sort(ids.begin(), ids.begin() + static_cast<std::ptrdiff_t>(keep), ids.end(),
                      [&](std::size_t a, std::size_t b) {
                        return logits[a] > logits[b] || (logits[a] == logits[b] && a < b);
                      });
  }
  double max_logit = -INFINITY;
  for (std::size_t i = 0; i < keep; ++i) max_logit = std::max(max_logit, double{logits[ids[i]]});
  std::vector<double> p(n, 0.0);
  double sum = 0;
  for (std::size_t i = 0; i < keep; ++i) {
    const double e = std::exp((double{logits[ids[i]]} - max_logit) / temperature);
    p[ids[i]] = e;
    sum += e;
  }
  for (double& x : p) x /= sum;
  return p;
}

std::int32_t sample_token(std::span<const float> logits, const sampling_options& o,
                          std::int64_t draw) {
  check_sampling_options(o);
  if (logits.empty()) throw std::invalid_argument("sample_token: no logits");
  if (o.temperature == 0) {
    const auto best = std::max_element(logits.begin(), logits.end());  // the first of equal maxima
    return static_cast<std::int32_t>(best - logits.begin());
  }
  const std::vector<double> p = sampling_probabilities(logits, o.temperature, o.top_k);
  const std::uint64_t key = splitmix64(o.seed ^ fnv1a64("sample_token"));
  const double u = uniform_open01(key + static_cast<std::uint64_t>(draw));
  double cumulative = 0;
  std::size_t last = 0;  // the last id with a nonzero probability (rounding of the sum)
  for (std::size_t i = 0; i < p.size(); ++i) {
    if (p[i] == 0) continue;
    last = i;
    cumulative += p[i];
    if (u < cumulative) return static_cast<std::int32_t>(i);
  }
  return static_cast<std::int32_t>(last);
}

next_token_logits::next_token_logits(const gpt_chunk& model) : model_(model) {
  const auto& r = model.range();
  if (!r.embedding || !r.head || r.first_layer != 0 || r.last_layer != model.config().layers ||
      model.shard().split())
    throw std::invalid_argument("next_token_logits: needs the whole model in one chunk");
}

std::span<const float> next_token_logits::operator()(std::span<const std::int32_t> window) {
  const gpt_config& c = model_.config();
  const int T = static_cast<int>(window.size());
  if (T < 1 || T > c.context)
    throw std::invalid_argument("next_token_logits: a window of " + std::to_string(T) +
                                " tokens, not 1 to context " + std::to_string(c.context));
  for (const std::int32_t id : window)
    if (id < 0 || id >= c.vocab_size)
      throw std::invalid_argument("next_token_logits: token id " + std::to_string(id) +
                                  " is outside the vocabulary [0, " + std::to_string(c.vocab_size) +
                                  ")");
  if (!acts_ || acts_->seq_len() != T) acts_ = std::make_unique<gpt_activations>(model_, 1, T);
  tokens_.assign(window.begin(), window.end());
  chunk_forward(model_, *acts_, tokens_.data(), nullptr);
  const float* last = chunk_output(*acts_) + std::int64_t{T - 1} * c.padded_vocab_size;
  return {last, static_cast<std::size_t>(c.vocab_size)};
}

std::vector<std::int32_t> generate(const logits_function& logits_of, int context, int vocab_size,
                                   std::span<const std::int32_t> prompt, int new_tokens,
                                   const sampling_options& o, int vocab_limit,
                                   const std::function<void(std::int32_t)>& on_token) {
  check_sampling_options(o);
  if (prompt.empty()) throw std::invalid_argument("generate: the prompt has no tokens");
  if (new_tokens < 0) throw std::invalid_argument("generate: new_tokens must be >= 0");
  if (vocab_limit <= 0 || vocab_limit > vocab_size) vocab_limit = vocab_size;
  std::vector<std::int32_t> tokens(prompt.begin(), prompt.end());
  std::vector<std::int32_t> out;
  out.reserve(static_cast<std::size_t>(new_tokens));
  for (int i = 0; i < new_tokens; ++i) {
    const std::size_t T = std::min(tokens.size(), static_cast<std::size_t>(context));
    const std::span<const std::int32_t> window(tokens.data() + tokens.size() - T, T);
    const std::vector<float> logits = logits_of(window);
    if (static_cast<int>(logits.size()) < vocab_limit)
      throw std::logic_error("generate: " + std::to_string(logits.size()) + " logits for " +
                             std::to_string(vocab_limit) + " ids");
    const std::int32_t next = sample_token(
        std::span<const float>(logits).first(static_cast<std::size_t>(vocab_limit)), o, i);
    tokens.push_back(next);
    out.push_back(next);
    if (on_token) on_token(next);
  }
  return out;
}

std::vector<std::int32_t> generate(const gpt_chunk& model, std::span<const std::int32_t> prompt,
                                   int new_tokens, const sampling_options& o, int vocab_limit,
                                   const std::function<void(std::int32_t)>& on_token) {
  next_token_logits logits_of(model);
  const auto cpu = [&](std::span<const std::int32_t> window) {
    const auto l = logits_of(window);
    return std::vector<float>(l.begin(), l.end());
  };
  return generate(cpu, model.config().context, model.config().vocab_size, prompt, new_tokens, o,
                  vocab_limit, on_token);
}

}  // namespace troupe::engine
