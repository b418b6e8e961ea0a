// batch_sampler: micro-batches of B*T int32 inputs and targets (targets = inputs shifted one
// token) from a token_corpus. Micro-batch i of DP rank k is global batch g = i*dp_size + k, and
// its contents are a pure function of (corpus, config, g): resumable from any position and
// disjointly shardable across ranks. The sampler borrows nothing: it holds a corpus view.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "engine/data/corpus.hpp"

namespace troupe::engine::data {

enum class sample_order { random, sequential };

// "random" or "sequential"; anything else throws std::runtime_error listing the valid values.
sample_order parse_sample_order(std::string_view name);
std::string_view to_string(sample_order order);

struct sampler_config {
  std::int64_t B = 1;  // rows per micro-batch
  std::int64_t T = 1;  // tokens per row
  sample_order order = sample_order::random;
  std::uint64_t seed = 0;
  std::int64_t dp_rank = 0;
  std::int64_t dp_size = 1;
};

class batch_sampler {
 public:
  // Validates the config and that the corpus is large enough: sequential needs B*T+1 tokens,
  // random needs T+1. Errors are std::runtime_error naming the corpus source.
  batch_sampler(token_corpus corpus, sampler_config config);

  // Fills inputs[B*T] and targets[B*T] for this rank's micro-batch i (i >= 0). Pure in i.
  void fill(std::int64_t i, std::int32_t* inputs, std::int32_t* targets) const;

  // Corpus offset of the T+1 tokens read by row r of this rank's micro-batch i.
  //   sequential: ((g mod n_batches)*B + r)*T
  //   random:     uniform in [0, ntokens - T - 1] from hash(seed, g, r)
  std::int64_t row_offset(std::int64_t i, std::int64_t r) const;

  // Stateful convenience: fill(position()) and advance by one.
  void next(std::int32_t* inputs, std::int32_t* targets);
  std::int64_t position() const { return position_; }
  void set_position(std::int64_t i);

  // Whole micro-batches in one sequential pass: (ntokens - 1) / (B*T) (0 if none fit).
  std::int64_t n_batches() const { return n_batches_; }
  std::int64_t batch_tokens() const { return config_.B * config_.T; }
  const sampler_config& config() const { return config_; }
  const token_corpus& corpus() const { return corpus_; }

 private:
  token_corpus corpus_;
  sampler_config config_;
  std::int64_t n_batches_ = 0;
  std::int64_t position_ = 0;
};

}  // namespace troupe::engine::data
