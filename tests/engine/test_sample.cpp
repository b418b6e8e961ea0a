// Sampling (engine/model/sample.hpp): temperature 0 is the argmax whatever the seed, top-k draws
// only the k largest logits, the same seed draws the same tokens, the temperature scales the logits
// of the softmax (and the draws follow those probabilities); the next-token logits are the last
// position's of a forward pass over the window (padded vocabulary rows left out), the window is
// the last `context` tokens, and generation is deterministic in its seed.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <set>
#include <vector>

#include "engine/model/sample.hpp"
#include "tests/engine/engine_test_util.hpp"

using namespace troupe::engine;
using namespace troupe::engine::test;

namespace {

std::vector<float> test_logits(int n, std::uint64_t salt) {
  std::vector<float> l(static_cast<std::size_t>(n));
  for (int i = 0; i < n; ++i)
    l[static_cast<std::size_t>(i)] = static_cast<float>(
        4 * uniform_open01(splitmix64(salt) + static_cast<std::uint64_t>(i)) - 2);
  return l;
}

std::vector<double> softmax(const std::vector<float>& l, double temperature) {
  double m = l[0];
  for (const float x : l) m = std::max(m, double{x});
  std::vector<double> p;
  double sum = 0;
  for (const float x : l) sum += std::exp((x - m) / temperature);
  for (const float x : l) p.push_back(std::exp((x - m) / temperature) / sum);
  return p;
}

// The logits of every position of a forward pass over tokens.
std::vector<float> all_logits(const gpt_chunk& model, const std::vector<std::int32_t>& tokens) {
  gpt_activations acts(model, 1, static_cast<int>(tokens.size()));
  chunk_forward(model, acts, tokens.data(), nullptr);
  const float* out = chunk_output(acts);
  return std::vector<float>(out, out + tokens.size() * model.config().padded_vocab_size);
}

}  // namespace

TEST_CASE("temperature 0 is the argmax, the lowest id among ties, whatever the seed",
          "[unit][sample]") {
  const auto l = test_logits(50, 1);
  const auto best = std::max_element(l.begin(), l.end()) - l.begin();
  for (std::uint64_t seed : {0ull, 1ull, 12345ull})
    for (std::int64_t draw : {0, 1, 99}) CHECK(sample_token(l, {0.0, 0, seed}, draw) == best);
  CHECK(sample_token(l, {0.0, 5, 3}, 0) == best);  // top-k does not change the argmax
  const std::vector<float> ties = {0.5f, 2.0f, -1.0f, 2.0f, 2.0f};
  CHECK(sample_token(ties, {0.0, 0, 7}, 0) == 1);
}

TEST_CASE("top-k: only the k largest logits can be drawn", "[unit][sample]") {
  const auto l = test_logits(40, 2);
  std::vector<int> order(l.size());
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(), [&](int a, int b) { return l[a] > l[b]; });
  const std::set<int> top(order.begin(), order.begin() + 5);

  const auto p = sampling_probabilities(l, 1.0, 5);
  double sum = 0;
  for (std::size_t i = 0; i < p.size(); ++i) {
    CHECK((p[i] > 0) == (top.count(static_cast<int>(i)) == 1));
    sum += p[i];
  }
  CHECK(sum == Approx(1.0));
  // Within the top k, the softmax of those logits alone.
  std::vector<float> kept;
  for (const int i : order) {
    if (top.count(i)) kept.push_back(l[static_cast<std::size_t>(i)]);
  }
  const auto q = softmax(kept, 1.0);
  for (std::size_t j = 0; j < kept.size(); ++j)
    CHECK(p[static_cast<std::size_t>(order[j])] == Approx(q[j]).epsilon(1e-12));

  std::set<int> drawn;
  for (std::int64_t d = 0; d < 2000; ++d) drawn.insert(sample_token(l, {1.5, 5, 11}, d));
  CHECK(drawn == top);  // every one of the top 5, nothing else

  // top_k 1 is greedy; top_k >= the count keeps every id; ties at the cut go to the lower id.
  for (std::int64_t d = 0; d < 50; ++d) CHECK(sample_token(l, {2.0, 1, 3}, d) == order[0]);
  for (const double x : sampling_probabilities(l, 1.0, 40)) CHECK(x > 0);
  const std::vector<float> ties = {1.0f, 3.0f, 3.0f, 3.0f, 0.0f};
  const auto t = sampling_probabilities(ties, 1.0, 2);
  CHECK(t == std::vector<double>{0.0, 0.5, 0.5, 0.0, 0.0});
}

TEST_CASE("the same seed draws the same tokens; another seed others", "[unit][sample]") {
  const std::vector<float> flat(64, 0.0f);
  auto draws = [&](std::uint64_t seed) {
    std::vector<std::int32_t> out;
    for (std::int64_t d = 0; d < 100; ++d) out.push_back(sample_token(flat, {1.0, 0, seed}, d));
    return out;
  };
  CHECK(draws(42) == draws(42));
  CHECK(draws(42) != draws(43));
  const auto a = draws(42);
  CHECK(std::set<std::int32_t>(a.begin(), a.end()).size() > 30);  // spread, not one token
}

TEST_CASE("temperature divides the logits before the softmax", "[unit][sample]") {
  const auto l = test_logits(12, 3);
  for (const double temperature : {0.25, 1.0, 3.0}) {
    const auto p = sampling_probabilities(l, temperature, 0);
    const auto want = softmax(l, temperature);
    for (std::size_t i = 0; i < p.size(); ++i) CHECK(p[i] == Approx(want[i]).epsilon(1e-12));
  }
  // Lower temperature: the most likely token more likely; higher: closer to uniform.
  const auto best = static_cast<std::size_t>(std::max_element(l.begin(), l.end()) - l.begin());
  CHECK(sampling_probabilities(l, 0.25, 0)[best] > sampling_probabilities(l, 1.0, 0)[best]);
  CHECK(sampling_probabilities(l, 1.0, 0)[best] > sampling_probabilities(l, 100.0, 0)[best]);
  CHECK(sampling_probabilities(l, 100.0, 0)[best] == Approx(1.0 / 12).epsilon(0.05));
  // The draws follow the probabilities.
  const auto p = sampling_probabilities(l, 0.7, 0);
  std::vector<int> count(l.size(), 0);
  const int n = 40000;
  for (std::int64_t d = 0; d < n; ++d)
    ++count[static_cast<std::size_t>(sample_token(l, {0.7, 0, 5}, d))];
  for (std::size_t i = 0; i < l.size(); ++i) {
    const double sigma = std::sqrt(p[i] * (1 - p[i]) / n);
    CHECK(std::abs(count[i] / double(n) - p[i]) < 5 * sigma + 1e-9);
  }
}

TEST_CASE("sampling options out of range are refused", "[unit][sample]") {
  const std::vector<float> l = {1, 2, 3};
  CHECK(error_message<std::invalid_argument>([&] {
          sample_token(l, {-1.0, 0, 1}, 0);
        }).starts_with("temperature:"));
  CHECK(error_message<std::invalid_argument>([&] {
          sample_token(l, {NAN, 0, 1}, 0);
        }).starts_with("temperature:"));
  CHECK(error_message<std::invalid_argument>([&] {
          sample_token(l, {1.0, -2, 1}, 0);
        }).starts_with("top_k:"));
}

TEST_CASE("next-token logits: the last position of the window, no padded rows", "[unit][sample]") {
  const gpt_config c = tiny_config();  // vocab 11 (padded 16), context 8
  gpt_chunk model(c, chunk_range::whole(c));
  randomize_params(model, 9, 0.25f);  // padded wte rows nonzero: their logits would show
  const std::vector<std::int32_t> tokens = {3, 1, 4, 1, 5, 9, 2, 6};
  const auto every = all_logits(model, tokens);
  next_token_logits logits_of(model);
  for (std::size_t T = 1; T <= tokens.size(); ++T) {
    const auto got = logits_of(std::span(tokens.data(), T));
    REQUIRE(got.size() == 11);
    // Causal: position T-1 of the whole sequence sees what the window of T tokens sees.
    const std::vector<float> want(every.begin() + (T - 1) * 16, every.begin() + (T - 1) * 16 + 11);
    CHECK(relative_difference(std::vector<float>(got.begin(), got.end()), want) < 1e-5);
  }
  CHECK_THROWS_AS(logits_of(std::vector<std::int32_t>(9, 0)), std::invalid_argument);
  CHECK_THROWS_AS(logits_of(std::vector<std::int32_t>{11}), std::invalid_argument);
  const gpt_chunk first(c, {0, 1, true, false});
  CHECK_THROWS_AS(next_token_logits(first), std::invalid_argument);
}

TEST_CASE("generate: greedy follows the argmax over the last context tokens; seeded draws repeat",
          "[unit][sample]") {
  const gpt_config c = tiny_config();
  gpt_chunk model(c, chunk_range::whole(c));
  randomize_params(model, 10, 0.25f);
  const std::vector<std::int32_t> prompt = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10};  // longer than context
  std::vector<std::int32_t> seen;
  const auto greedy =
      generate(model, prompt, 6, {0.0, 0, 1}, 0, [&](std::int32_t t) { seen.push_back(t); });
  CHECK(seen == greedy);
  REQUIRE(greedy.size() == 6);
  // Each token is the argmax of a forward over the 8 tokens before it.
  std::vector<std::int32_t> all = prompt;
  for (const std::int32_t t : greedy) {
    const std::vector<std::int32_t> window(all.end() - 8, all.end());
    const auto every = all_logits(model, window);
    const auto last = every.begin() + 7 * 16;
    CHECK(t == std::max_element(last, last + 11) - last);
    all.push_back(t);
  }
  const auto a = generate(model, prompt, 20, {1.0, 0, 77});
  CHECK(a == generate(model, prompt, 20, {1.0, 0, 77}));
  CHECK(a != generate(model, prompt, 20, {1.0, 0, 78}));
  // vocab_limit: only ids below it.
  for (const std::int32_t t : generate(model, prompt, 30, {5.0, 0, 3}, 4)) CHECK(t < 4);
  CHECK(generate(model, prompt, 0, {}).empty());
  CHECK_THROWS_AS(generate(model, {}, 3, {}), std::invalid_argument);
}
