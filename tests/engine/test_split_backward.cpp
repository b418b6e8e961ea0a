// Split backward (B = chunk_backward_input, W = chunk_backward_weight) against the whole
// chunk_backward, for a first, a middle, a last and a whole-model chunk of a tiny model:
// B then W gives the same dinput and gradients bitwise; micro-batches may run B0 B1 W1 W0;
// B alone touches no gradient; W without B throws; the gradient blocks cover every parameter
// once, and on_block_done fires once per block, in order, when the block's gradient is final.
// The passes (block_pass) read only the parameter blocks of their latest stop: run with every
// other parameter poisoned (NaN), they give the plain functions' numbers bitwise (ZeRO-3 runs them
// with only the stop's buckets gathered). Activation checkpointing (block_scratch) gives the same
// gradients bitwise, whole and split, and holds exactly the bytes the memory plan says.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "engine/model/gpt_model.hpp"
#include "tests/engine/engine_test_util.hpp"

using namespace troupe::engine;
using namespace troupe::engine::test;

namespace {

struct stage_case {
  const char* name;
  chunk_range range;
};

// 3 layers: first = embedding + h.0, middle = h.1, last = h.2 + head, whole = everything.
const gpt_config kConfig = tiny_config(3);

std::vector<stage_case> all_cases() {
  return {{"first", {0, 1, true, false}},
          {"middle", {1, 2, false, false}},
          {"last", {2, 3, false, true}},
          {"whole", {0, 3, true, true}}};
}

// One micro-batch's inputs for a chunk in isolation: tokens/targets, a hidden-state input (for
// chunks without the embedding) and an output gradient (for chunks without the head).
struct micro_data {
  micro_batch mb;
  std::vector<float> input, doutput;
};

micro_data make_micro(std::uint32_t seed, int B = 2, int T = 5) {
  micro_data d{make_batch(kConfig, B, T, seed), {}, {}};
  std::mt19937 rng(seed * 31 + 7);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  const std::size_t NC = std::size_t(B) * T * std::size_t(kConfig.width);
  d.input.resize(NC);
  d.doutput.resize(NC);
  for (auto& x : d.input) x = u(rng);
  for (auto& x : d.doutput) x = 0.1f * u(rng);
  return d;
}

// A chunk with parameters far from init and gradients already holding something, so that the
// tests see accumulation (+=), not overwriting.
std::unique_ptr<gpt_chunk> make_stage(const chunk_range& range) {
  auto s = std::make_unique<gpt_chunk>(kConfig, range);
  randomize_params(*s, 42);
  std::mt19937 rng(5);
  std::uniform_real_distribution<float> u(-0.01f, 0.01f);
  s->zero_grad();
  for (const auto& p : s->parameters()) {
    for (std::int64_t i = 0; i < p.numel; ++i) s->grads()[p.offset + i] = u(rng);
  }
  return s;
}

// Forward, plus the loss gradient on a last chunk: ready for backward.
void forward(const gpt_chunk& s, gpt_activations& acts, const micro_data& d) {
  const bool emb = s.range().embedding;
  chunk_forward(s, acts, emb ? d.mb.tokens.data() : nullptr, emb ? nullptr : d.input.data());
  if (s.range().head) chunk_loss_backward_start(s, acts, d.mb.targets.data(), 1.0f);
}

const float* doutput_of(const gpt_chunk& s, const micro_data& d) {
  return s.range().head ? nullptr : d.doutput.data();
}

std::vector<float> grads_of(const gpt_chunk& s) {
  return std::vector<float>(s.grads(), s.grads() + s.parameter_count());
}

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

// max |a - b| over max |b|.
double rel_diff(const std::vector<float>& a, const std::vector<float>& b) {
  REQUIRE(a.size() == b.size());
  double diff = 0, mag = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    diff = std::max(diff, std::abs(double(a[i]) - double(b[i])));
    mag = std::max(mag, std::abs(double(b[i])));
  }
  return mag > 0 ? diff / mag : diff;
}

std::vector<float> nan_buffer() {
  return std::vector<float>(std::size_t(2) * 5 * std::size_t(kConfig.width), std::nanf(""));
}

}  // namespace

TEST_CASE("B then W gives chunk_backward's dinput and gradients", "[split_backward]") {
  const stage_case sc = GENERATE(from_range(all_cases()));
  INFO("chunk " << sc.name);
  const micro_data d = make_micro(3);
  auto whole = make_stage(sc.range);
  auto split = make_stage(sc.range);
  gpt_activations wa(*whole, 2, 5), sa(*split, 2, 5);
  auto din_whole = nan_buffer(), din_split = nan_buffer();  // overwritten, not accumulated
  float* dw = sc.range.embedding ? nullptr : din_whole.data();
  float* ds = sc.range.embedding ? nullptr : din_split.data();

  forward(*whole, wa, d);
  chunk_backward(*whole, wa, doutput_of(*whole, d), dw);
  forward(*split, sa, d);
  const auto before = grads_of(*split);
  chunk_backward_input(*split, sa, doutput_of(*split, d), ds);
  CHECK(same_bits(grads_of(*split), before));  // B touches no parameter gradient
  if (!sc.range.embedding) {
    INFO("dinput relative difference " << rel_diff(din_split, din_whole));
    CHECK(same_bits(din_split, din_whole));
  }
  chunk_backward_weight(*split, sa);
  INFO("gradient relative difference " << rel_diff(grads_of(*split), grads_of(*whole)));
  CHECK(same_bits(grads_of(*split), grads_of(*whole)));
  CHECK(!same_bits(grads_of(*split), before));
}

TEST_CASE("micro-batches in the order B0 B1 W1 W0 accumulate what whole backward does",
          "[split_backward]") {
  const stage_case sc = GENERATE(from_range(all_cases()));
  INFO("chunk " << sc.name);
  const micro_data d0 = make_micro(11), d1 = make_micro(12);
  auto whole = make_stage(sc.range);
  auto split = make_stage(sc.range);
  const bool emb = sc.range.embedding;

  gpt_activations wa(*whole, 2, 5);
  std::vector<std::vector<float>> din_whole{nan_buffer(), nan_buffer()};
  forward(*whole, wa, d0);
  chunk_backward(*whole, wa, doutput_of(*whole, d0), emb ? nullptr : din_whole[0].data());
  forward(*whole, wa, d1);
  chunk_backward(*whole, wa, doutput_of(*whole, d1), emb ? nullptr : din_whole[1].data());

  gpt_activations a0(*split, 2, 5), a1(*split, 2, 5);
  std::vector<std::vector<float>> din_split{nan_buffer(), nan_buffer()};
  forward(*split, a0, d0);
  forward(*split, a1, d1);
  chunk_backward_input(*split, a0, doutput_of(*split, d0), emb ? nullptr : din_split[0].data());
  chunk_backward_input(*split, a1, doutput_of(*split, d1), emb ? nullptr : din_split[1].data());
  chunk_backward_weight(*split, a1);
  chunk_backward_weight(*split, a0);

  if (!emb) {
    CHECK(same_bits(din_split[0], din_whole[0]));
    CHECK(same_bits(din_split[1], din_whole[1]));
  }
  // Summed in another order: equal within rounding.
  CHECK(rel_diff(grads_of(*split), grads_of(*whole)) <= 1e-6);
}

TEST_CASE("split backward misuse throws std::logic_error", "[split_backward]") {
  const stage_case sc = GENERATE(from_range(all_cases()));
  INFO("chunk " << sc.name);
  const micro_data d = make_micro(21);
  auto s = make_stage(sc.range);
  gpt_activations acts(*s, 2, 5);
  auto din = nan_buffer();
  float* dinput = sc.range.embedding ? nullptr : din.data();
  const auto start = grads_of(*s);

  // W before any B, and W after a forward without B.
  CHECK_THROWS_AS(chunk_backward_weight(*s, acts), std::logic_error);
  forward(*s, acts, d);
  CHECK(error_message<std::logic_error>([&] {
          chunk_backward_weight(*s, acts);
        }).find("chunk_backward_input") != std::string::npos);
  CHECK(same_bits(grads_of(*s), start));

  chunk_backward_input(*s, acts, doutput_of(*s, d), dinput);
  // While W is pending: a second B and a new forward would lose what W needs.
  CHECK_THROWS_AS(chunk_backward_input(*s, acts, doutput_of(*s, d), dinput), std::logic_error);
  const bool emb = sc.range.embedding;
  CHECK_THROWS_AS(
      chunk_forward(*s, acts, emb ? d.mb.tokens.data() : nullptr, emb ? nullptr : d.input.data()),
      std::logic_error);
  CHECK(same_bits(grads_of(*s), start));  // nothing so far touched a gradient
  chunk_backward_weight(*s, acts);
  const auto after = grads_of(*s);
  CHECK(!same_bits(after, start));
  // A second W does not add the gradients twice.
  CHECK_THROWS_AS(chunk_backward_weight(*s, acts), std::logic_error);
  CHECK(same_bits(grads_of(*s), after));
  // After W the activations take a new forward.
  CHECK_NOTHROW(forward(*s, acts, d));
}

TEST_CASE("B on a last chunk needs the loss first", "[split_backward]") {
  auto s = make_stage({2, 3, false, true});
  gpt_activations acts(*s, 2, 5);
  const micro_data d = make_micro(4);
  chunk_forward(*s, acts, nullptr, d.input.data());
  auto din = nan_buffer();
  CHECK_THROWS_AS(chunk_backward_input(*s, acts, nullptr, din.data()), std::logic_error);
}

TEST_CASE("grad blocks cover every parameter once, in backward order", "[split_backward]") {
  const stage_case sc = GENERATE(from_range(all_cases()));
  INFO("chunk " << sc.name);
  gpt_chunk s(kConfig, sc.range);
  const auto blocks = chunk_grad_blocks(s);

  std::vector<std::string> expected;
  if (sc.range.head) expected.push_back("head");
  for (int l = sc.range.last_layer; l-- > sc.range.first_layer;) {
    expected.push_back("h." + std::to_string(l));
  }
  if (sc.range.embedding) expected.push_back("embedding");
  std::vector<std::string> names;
  for (const auto& b : blocks) names.push_back(b.name);
  CHECK(names == expected);

  // Which block holds each element of the flat buffer (-1: none, -2: more than one).
  std::vector<int> owner(static_cast<std::size_t>(s.parameter_count()), -1);
  for (std::size_t b = 0; b < blocks.size(); ++b) {
    INFO("block " << blocks[b].name);
    CHECK(!blocks[b].ranges.empty());
    std::int64_t prev_end = 0;
    for (const auto& [offset, numel] : blocks[b].ranges) {
      CHECK(offset >= prev_end);  // increasing, not overlapping
      REQUIRE(offset >= 0);
      REQUIRE(numel > 0);
      REQUIRE(offset + numel <= s.parameter_count());
      prev_end = offset + numel;
      for (std::int64_t i = offset; i < offset + numel; ++i) {
        auto& o = owner[static_cast<std::size_t>(i)];
        o = o == -1 ? static_cast<int>(b) : -2;
      }
    }
  }
  for (const auto& p : s.parameters()) {
    INFO("parameter " << p.name);
    const int o = owner[static_cast<std::size_t>(p.offset)];
    CHECK(o >= 0);
    for (std::int64_t i = p.offset; i < p.offset + p.numel; ++i) {
      REQUIRE(owner[static_cast<std::size_t>(i)] == o);
    }
    if (o < 0) continue;
    const std::string& block = blocks[static_cast<std::size_t>(o)].name;
    if (p.name == "transformer.wte.weight") {
      CHECK(block == (sc.range.embedding ? "embedding" : "head"));
    } else if (p.name.starts_with("transformer.h.")) {
      CHECK(p.name.starts_with("transformer." + block + "."));
    } else if (p.name.starts_with("transformer.ln_f.")) {
      CHECK(block == "head");
    } else {
      CHECK(block == "embedding");
    }
  }
}

namespace {

// Records on_block_done: the order of the calls and each block's gradient at its call.
struct block_recorder {
  const gpt_chunk& chunk;
  std::vector<grad_block> blocks;
  std::vector<int> calls;
  std::vector<std::vector<float>> at_call;

  explicit block_recorder(const gpt_chunk& s) : chunk(s), blocks(chunk_grad_blocks(s)) {}
  std::vector<float> values(int b) const {
    std::vector<float> v;
    for (const auto& [offset, numel] : blocks[static_cast<std::size_t>(b)].ranges) {
      v.insert(v.end(), chunk.grads() + offset, chunk.grads() + offset + numel);
    }
    return v;
  }
  grad_block_fn callback() {
    return [this](int b) {
      REQUIRE(b >= 0);
      REQUIRE(b < static_cast<int>(blocks.size()));
      calls.push_back(b);
      at_call.push_back(values(b));
    };
  }
  // Once per block in order, and every block's gradient then equals its final value.
  void check() const {
    std::vector<int> expected(blocks.size());
    for (std::size_t i = 0; i < expected.size(); ++i) expected[i] = static_cast<int>(i);
    CHECK(calls == expected);
    for (std::size_t i = 0; i < calls.size(); ++i) {
      INFO("block " << blocks[static_cast<std::size_t>(calls[i])].name);
      CHECK(same_bits(at_call[i], values(calls[i])));
    }
  }
};

}  // namespace

TEST_CASE("on_block_done fires once per block, in order, when the block is final",
          "[split_backward]") {
  const stage_case sc = GENERATE(from_range(all_cases()));
  INFO("chunk " << sc.name);
  const micro_data d = make_micro(8);
  auto s = make_stage(sc.range);
  gpt_activations acts(*s, 2, 5);
  auto din = nan_buffer();
  float* dinput = sc.range.embedding ? nullptr : din.data();

  SECTION("chunk_backward") {
    auto ref = make_stage(sc.range);
    gpt_activations ref_acts(*ref, 2, 5);
    forward(*ref, ref_acts, d);
    chunk_backward(*ref, ref_acts, doutput_of(*ref, d), dinput);  // no callback

    block_recorder rec(*s);
    forward(*s, acts, d);
    chunk_backward(*s, acts, doutput_of(*s, d), dinput, rec.callback());
    rec.check();
    CHECK(same_bits(grads_of(*s), grads_of(*ref)));  // the callback changes no number
  }
  SECTION("chunk_backward_weight") {
    block_recorder rec(*s);
    forward(*s, acts, d);
    chunk_backward_input(*s, acts, doutput_of(*s, d), dinput);
    CHECK(rec.calls.empty());
    chunk_backward_weight(*s, acts, rec.callback());
    rec.check();
  }
}

namespace {

// Drives a pass the way a ZeRO-3 chunk does: at each stop only the stop's blocks hold their
// parameters; every other parameter (and the whole buffer before the first stop) reads NaN.
void run_poisoned(gpt_chunk& s, block_pass pass, pass_kind kind, bool recompute) {
  const std::vector<float> saved(s.params(), s.params() + s.parameter_count());
  const auto blocks = chunk_grad_blocks(s);
  const auto want = pass_stops(s, kind, recompute);
  auto poison = [&] { std::fill(s.params(), s.params() + s.parameter_count(), std::nanf("")); };
  poison();
  std::size_t stops = 0;
  while (const auto* stop = pass.next()) {
    REQUIRE(stops < want.size());
    REQUIRE(*stop == want[stops++]);
    poison();
    for (int b : *stop)
      for (const auto& [offset, n] : blocks.at(std::size_t(b)).ranges)
        std::copy(saved.begin() + offset, saved.begin() + offset + n, s.params() + offset);
  }
  REQUIRE(stops == want.size());
  std::copy(saved.begin(), saved.end(), s.params());
}

}  // namespace

TEST_CASE("passes read only the parameter blocks of their latest stop", "[split_backward]") {
  const stage_case sc = GENERATE(from_range(all_cases()));
  const bool split = GENERATE(false, true);
  const bool recompute = GENERATE(false, true);
  CAPTURE(sc.name, split, recompute);
  const auto d = make_micro(11);
  const bool emb = sc.range.embedding;
  auto plain = make_stage(sc.range);
  auto gated = make_stage(sc.range);
  std::shared_ptr<block_scratch> scratch;
  if (recompute) scratch = std::make_shared<block_scratch>(kConfig, 2, 5);
  gpt_activations pa(*plain, 2, 5), ga(*gated, 2, 5, scratch);
  auto pd = nan_buffer(), gd = nan_buffer();
  float* pdin = emb ? nullptr : pd.data();
  float* gdin = emb ? nullptr : gd.data();

  forward(*plain, pa, d);
  run_poisoned(*gated,
               chunk_forward_pass(*gated, ga, emb ? d.mb.tokens.data() : nullptr,
                                  emb ? nullptr : d.input.data()),
               pass_kind::forward, recompute);
  if (gated->range().head) {
    chunk_loss_backward_start(*gated, ga, d.mb.targets.data(), 1.0f);
  } else {
    const std::size_t n = std::size_t(2) * 5 * std::size_t(kConfig.width);
    REQUIRE(std::memcmp(chunk_output(pa), chunk_output(ga), n * sizeof(float)) == 0);
  }
  if (split) {
    chunk_backward_input(*plain, pa, doutput_of(*plain, d), pdin);
    chunk_backward_weight(*plain, pa);
    run_poisoned(*gated, chunk_backward_input_pass(*gated, ga, doutput_of(*gated, d), gdin),
                 pass_kind::backward, recompute);
    // Weight gradients read no parameter, unless W recomputes the blocks: then it stops before
    // each layer.
    CHECK(pass_stops(*gated, pass_kind::weight, recompute).size() ==
          (recompute ? std::size_t(sc.range.last_layer - sc.range.first_layer) : 0));
    run_poisoned(*gated, chunk_backward_weight_pass(*gated, ga, {}), pass_kind::weight, recompute);
  } else {
    chunk_backward(*plain, pa, doutput_of(*plain, d), pdin);
    run_poisoned(*gated, chunk_backward_pass(*gated, ga, doutput_of(*gated, d), gdin, {}),
                 pass_kind::backward, recompute);
  }
  REQUIRE(same_bits(grads_of(*gated), grads_of(*plain)));
  if (!emb) REQUIRE(same_bits(gd, pd));
}

// ---- activation checkpointing ------------------------------------------------------------------

TEST_CASE("checkpointed blocks give bitwise the gradients of saved ones, whole and split",
          "[split_backward][recompute]") {
  const stage_case sc = GENERATE(from_range(all_cases()));
  const bool split = GENERATE(false, true);
  INFO("chunk " << sc.name << (split ? ", split backward" : ", whole backward"));
  auto plain = make_stage(sc.range);
  auto ckpt = make_stage(sc.range);
  auto scratch = std::make_shared<block_scratch>(kConfig, 2, 5);
  gpt_activations pa(*plain, 2, 5), ca(*ckpt, 2, 5, scratch);
  CHECK(ca.recomputes());
  CHECK_FALSE(pa.recomputes());
  auto din_plain = nan_buffer(), din_ckpt = nan_buffer();
  float* dp = sc.range.embedding ? nullptr : din_plain.data();
  float* dc = sc.range.embedding ? nullptr : din_ckpt.data();
  // Two micro-batches through the same scratch: the second forward overwrites what the first
  // left there, so the first's backward must recompute, not read stale values.
  const micro_data d0 = make_micro(3), d1 = make_micro(4);
  gpt_activations other(*ckpt, 2, 5, scratch);
  forward(*plain, pa, d0);
  forward(*ckpt, ca, d0);
  forward(*ckpt, other, d1);
  chunk_backward(*plain, pa, doutput_of(*plain, d0), dp);
  if (split) {
    chunk_backward_input(*ckpt, ca, doutput_of(*ckpt, d0), dc);
    forward(*ckpt, other, d1);  // B and W apart, another micro-batch's forward between them
    chunk_backward_weight(*ckpt, ca);
  } else {
    chunk_backward(*ckpt, ca, doutput_of(*ckpt, d0), dc);
  }
  if (!sc.range.embedding) CHECK(same_bits(din_ckpt, din_plain));
  INFO("gradient relative difference " << rel_diff(grads_of(*ckpt), grads_of(*plain)));
  CHECK(same_bits(grads_of(*ckpt), grads_of(*plain)));
}

TEST_CASE("activation bytes: what a micro-batch holds is what the plan says, and less checkpointed",
          "[split_backward][recompute]") {
  const stage_case sc = GENERATE(from_range(all_cases()));
  const bool split = GENERATE(false, true);
  INFO("chunk " << sc.name << (split ? ", split backward" : ", whole backward"));
  const micro_data d = make_micro(3);
  auto s = make_stage(sc.range);
  auto scratch = std::make_shared<block_scratch>(kConfig, 2, 5);
  CHECK(scratch->bytes() == block_scratch_bytes(kConfig, 2, 5));
  for (const bool recompute : {false, true}) {
    INFO((recompute ? "checkpointed" : "saved"));
    gpt_activations acts(*s, 2, 5, recompute ? scratch : nullptr);
    forward(*s, acts, d);
    float* din = nullptr;
    auto buf = nan_buffer();
    if (!sc.range.embedding) din = buf.data();
    if (split) {
      chunk_backward_input(*s, acts, doutput_of(*s, d), din);
      chunk_backward_weight(*s, acts);
    } else {
      chunk_backward(*s, acts, doutput_of(*s, d), din);
    }
    CHECK(acts.bytes() == activation_bytes(kConfig, sc.range, 2, 5, recompute, split));
  }
  const int layers = sc.range.last_layer - sc.range.first_layer;
  // Per block, checkpointing keeps the output only: the scratch's worth less per block.
  CHECK(activation_bytes(kConfig, sc.range, 2, 5, false, split) -
            activation_bytes(kConfig, sc.range, 2, 5, true, split) ==
        layers * block_scratch_bytes(kConfig, 2, 5));
}

TEST_CASE("a block_scratch serves only micro-batches of its shape", "[split_backward][recompute]") {
  gpt_chunk s(kConfig, {0, 3, true, true});
  auto scratch = std::make_shared<block_scratch>(kConfig, 2, 5);
  CHECK_THAT(error_message<std::invalid_argument>([&] { gpt_activations a(s, 2, 4, scratch); }),
             Catch::Contains("a block_scratch for micro-batches of 2x5, not 2x4"));
}
