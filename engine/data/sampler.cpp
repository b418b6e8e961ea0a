// batch_sampler implementation: sequential offsets by formula, random offsets by a
// counter-based splitmix64 hash of (seed, g, r) with unbiased rejection, so no hidden RNG
// state exists and fill(i) never depends on call history.
#include "engine/data/sampler.hpp"

#include "engine/model/random.hpp"

#include <limits>
#include <stdexcept>
#include <utility>

namespace troupe::engine::data {

sample_order parse_sample_order(std::string_view name) {
  if (name == "random") return sample_order::random;
  if (name == "sequential") return sample_order::sequential;
  throw std::runtime_error("unknown sample order '" + std::string(name) +
                           "': expected 'random' or 'sequential'");
}

std::string_view to_string(sample_order order) {
  return order == sample_order::random ? "random" : "sequential";
}

namespace {

// Uniform value in [0, range) from the stream keyed by (seed, g, r); range >= 1.
std::uint64_t uniform_below(std::uint64_t seed, std::uint64_t g, std::uint64_t r,
                            std::uint64_t range) {
  std::uint64_t state = splitmix64(splitmix64(splitmix64(seed) ^ g) ^ r);
  // Reject the low (2^64 mod range) values so the modulo is exactly uniform.
  const std::uint64_t threshold = (0 - range) % range;
  for (;;) {
    const std::uint64_t x = splitmix64(state);
    if (x >= threshold) return x % range;
    state += 0x9E3779B97F4A7C15ULL;
  }
}

std::string too_small(const token_corpus& corpus, std::int64_t need, const std::string& what) {
  return corpus.source() + ": corpus has " + std::to_string(corpus.size()) + " tokens but " + what +
         " = " + std::to_string(need) + " are needed";
}

}  // namespace

batch_sampler::batch_sampler(token_corpus corpus, sampler_config config)
    : corpus_(std::move(corpus)), config_(config) {
  const auto& c = config_;
  if (c.B <= 0 || c.T <= 0) {
    throw std::runtime_error("batch_sampler: B and T must be positive (got B=" +
                             std::to_string(c.B) + ", T=" + std::to_string(c.T) + ")");
  }
  if (c.B > std::numeric_limits<std::int64_t>::max() / c.T) {
    throw std::runtime_error("batch_sampler: B*T overflows");
  }
  if (c.dp_size < 1 || c.dp_rank < 0 || c.dp_rank >= c.dp_size) {
    throw std::runtime_error(
        "batch_sampler: need 0 <= dp_rank < dp_size (got dp_rank=" + std::to_string(c.dp_rank) +
        ", dp_size=" + std::to_string(c.dp_size) + ")");
  }
  const std::int64_t n = corpus_.size();
  n_batches_ = n >= 1 ? (n - 1) / (c.B * c.T) : 0;
  if (c.order == sample_order::sequential && n_batches_ < 1) {
    throw std::runtime_error(too_small(corpus_, c.B * c.T + 1, "B*T+1 (sequential order)"));
  }
  if (c.order == sample_order::random && n < c.T + 1) {
    throw std::runtime_error(too_small(corpus_, c.T + 1, "T+1 (random order)"));
  }
}

std::int64_t batch_sampler::row_offset(std::int64_t i, std::int64_t r) const {
  const auto& c = config_;
  if (i < 0)
    throw std::out_of_range("batch_sampler: negative micro-batch index " + std::to_string(i));
  if (r < 0 || r >= c.B)
    throw std::out_of_range("batch_sampler: row " + std::to_string(r) + " not in [0, B)");
  const std::uint64_t g = static_cast<std::uint64_t>(i) * static_cast<std::uint64_t>(c.dp_size) +
                          static_cast<std::uint64_t>(c.dp_rank);
  if (c.order == sample_order::sequential) {
    const auto gw = static_cast<std::int64_t>(g % static_cast<std::uint64_t>(n_batches_));
    return (gw * c.B + r) * c.T;
  }
  const auto range = static_cast<std::uint64_t>(corpus_.size() - c.T);  // offsets 0..n-T-1
  return static_cast<std::int64_t>(uniform_below(c.seed, g, static_cast<std::uint64_t>(r), range));
}

void batch_sampler::fill(std::int64_t i, std::int32_t* inputs, std::int32_t* targets) const {
  const auto& c = config_;
  for (std::int64_t r = 0; r < c.B; ++r) {
    const std::int64_t off = row_offset(i, r);
    corpus_.read(off, c.T, inputs + r * c.T);
    corpus_.read(off + 1, c.T, targets + r * c.T);
  }
}

void batch_sampler::next(std::int32_t* inputs, std::int32_t* targets) {
  fill(position_, inputs, targets);
  ++position_;
}

void batch_sampler::set_position(std::int64_t i) {
  if (i < 0) throw std::out_of_range("batch_sampler: negative position " + std::to_string(i));
  position_ = i;
}

}  // namespace troupe::engine::data
