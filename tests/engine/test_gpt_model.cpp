// GPT-2 chunk tests: whole-model finite-difference gradient check (every parameter tensor,
// ignored targets, padded vocabulary), pipeline partitions chained by hand against the whole
// model (loss, every gradient, the tied wte split across first and last chunk, init
// determinism), partition_layers, gpt_config::validate messages, the parameter layout, and
// gradient accumulation across backward passes.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <memory>
#include <set>
#include <vector>

#include "engine/model/gpt_model.hpp"
#include "tests/engine/engine_test_util.hpp"

using namespace troupe::engine;
using namespace troupe::engine::test;
namespace kernels = troupe::kernels;

namespace {

// max |a - b| over max |b| (absolute when b is all zero).
double rel_diff(const float* a, const float* b, std::int64_t n) {
  double diff = 0, mag = 0;
  for (std::int64_t i = 0; i < n; ++i) {
    diff = std::max(diff, std::abs(double(a[i]) - double(b[i])));
    mag = std::max(mag, std::abs(double(b[i])));
  }
  return mag > 0 ? diff / mag : diff;
}

double rel_diff(const std::vector<float>& a, const std::vector<float>& b) {
  REQUIRE(a.size() == b.size());
  return rel_diff(a.data(), b.data(), static_cast<std::int64_t>(a.size()));
}

std::vector<float> grad_values(const gpt_chunk& s, const std::string& name) {
  return tensor_values(s.grad(name));
}

}  // namespace

TEST_CASE("whole-model gradients match central finite differences", "[model][gradcheck]") {
  const gpt_config cfg = tiny_config();
  gpt_chunk model(cfg, chunk_range::whole(cfg));
  model.init_gpt2(1);
  randomize_params(model, 42);  // padded wte rows non-zero: the loss must ignore them
  const int B = 2, T = 5;
  const micro_batch mb = make_batch(cfg, B, T, 7);  // targets 1, 5, 9 are ignore_index
  gpt_activations acts(model, B, T);

  model.zero_grad();
  const auto r = model_backward(model, acts, mb);
  CHECK(r.count == 7);
  CHECK(r.mean() == Approx(r.loss_sum / 7));
  CHECK(std::isfinite(r.mean()));
  const std::vector<float> grads(model.grads(), model.grads() + model.parameter_count());

  // The loss without gradients matches the loss of the backward pass.
  CHECK(model_loss(model, acts, mb).loss_sum == Approx(r.loss_sum).epsilon(1e-12));

  auto loss = [&] { return model_loss(model, acts, mb).mean(); };
  std::mt19937 rng(3);
  const float eps = 1e-2f;
  int checked = 0;
  double worst = 0;
  std::string worst_at;
  std::set<std::string> tensors_checked;
  for (const auto& p : model.parameters()) {
    std::vector<std::int64_t> idx;
    if (p.numel <= 24) {
      for (std::int64_t i = 0; i < p.numel; ++i) idx.push_back(i);
    } else {
      std::uniform_int_distribution<std::int64_t> pick(0, p.numel - 1);
      for (int k = 0; k < 4; ++k) idx.push_back(pick(rng));
      idx.push_back(0);
      idx.push_back(p.numel - 1);
    }
    if (p.name == "transformer.wte.weight") {
      // A padded row entry and an entry of a token that occurs in the batch.
      idx.push_back(std::int64_t{cfg.vocab_size} * cfg.width + 3);
      idx.push_back(std::int64_t{mb.tokens[0]} * cfg.width + 5);
    }
    for (const std::int64_t i : idx) {
      float* w = model.params() + p.offset + i;
      const float orig = *w;
      *w = orig + eps;
      const double lp = loss();
      *w = orig - eps;
      const double lm = loss();
      *w = orig;
      const double h = double(orig + eps) - double(orig - eps);
      const double fd = (lp - lm) / h;
      const double an = grads[static_cast<std::size_t>(p.offset + i)];
      const double err = std::abs(fd - an);
      // Float forward: rounding noise in fd is ~1e-6; truncation error is O(eps^2). Both are
      // far below 1% of the gradient, with an absolute floor of 1e-4 for tiny gradients.
      const double tol = 1e-2 * std::max(1e-2, std::abs(an));
      INFO(p.name << "[" << i << "]: finite difference " << fd << ", analytic " << an);
      CHECK(err <= tol);
      if (err / tol > worst) {
        worst = err / tol;
        worst_at = p.name + "[" + std::to_string(i) + "]";
      }
      ++checked;
    }
    tensors_checked.insert(p.name);
  }
  INFO("worst error/tolerance " << worst << " at " << worst_at);
  CHECK(worst < 1.0);
  CHECK(tensors_checked.size() == model.parameters().size());
  CHECK(checked > 200);

  // Padded wte rows get exactly zero gradient (and the loss does not depend on them).
  const auto wte_grad = grad_values(model, "transformer.wte.weight");
  for (std::int64_t i = std::int64_t{cfg.vocab_size} * cfg.width; i < std::int64_t(wte_grad.size());
       ++i) {
    INFO("padded wte gradient entry " << i);
    REQUIRE(wte_grad[static_cast<std::size_t>(i)] == 0.0f);
  }
  // Sanity: real rows of tokens that occur do get gradient.
  double real = 0;
  for (std::int64_t i = 0; i < std::int64_t{cfg.vocab_size} * cfg.width; ++i) {
    real += std::abs(wte_grad[static_cast<std::size_t>(i)]);
  }
  CHECK(real > 0);
}

TEST_CASE("all targets ignored: zero loss count and zero gradients", "[model]") {
  const gpt_config cfg = tiny_config();
  gpt_chunk model(cfg, chunk_range::whole(cfg));
  model.init_gpt2(5);
  micro_batch mb = make_batch(cfg, 1, 4, 9);
  std::fill(mb.targets.begin(), mb.targets.end(), ignore_index);
  gpt_activations acts(model, 1, 4);
  model.zero_grad();
  const auto r = model_backward(model, acts, mb);
  CHECK(r.count == 0);
  CHECK(r.mean() == 0.0);
  for (std::int64_t i = 0; i < model.parameter_count(); ++i) REQUIRE(model.grads()[i] == 0.0f);
}

namespace {

struct pipeline_result {
  double loss = 0;
  std::vector<std::unique_ptr<gpt_chunk>> chunks;
};

// Runs forward + backward through `parts` chained by hand: each chunk's input is the previous
// chunk's output, each chunk's doutput is the next chunk's dinput.
pipeline_result run_pipeline(const gpt_config& cfg, const std::vector<chunk_range>& parts,
                             const micro_batch& mb, std::uint64_t seed) {
  pipeline_result out;
  std::vector<std::unique_ptr<gpt_activations>> acts;
  for (const auto& range : parts) {
    out.chunks.push_back(std::make_unique<gpt_chunk>(cfg, range));
    out.chunks.back()->init_gpt2(seed);
    out.chunks.back()->zero_grad();
    acts.push_back(std::make_unique<gpt_activations>(*out.chunks.back(), mb.B, mb.T));
  }
  const std::size_t n = parts.size();
  for (std::size_t s = 0; s < n; ++s) {
    if (s == 0) {
      chunk_forward(*out.chunks[s], *acts[s], mb.tokens.data(), nullptr);
    } else {
      chunk_forward(*out.chunks[s], *acts[s], nullptr, chunk_output(*acts[s - 1]));
    }
  }
  // The forward-only loss and the backward-start loss agree.
  const double fwd_loss = chunk_loss(*out.chunks.back(), *acts.back(), mb.targets.data()).mean();
  out.loss =
      chunk_loss_backward_start(*out.chunks.back(), *acts.back(), mb.targets.data(), 1.0f).mean();
  CHECK(fwd_loss == out.loss);
  const std::size_t NC = std::size_t(mb.B) * mb.T * std::size_t(cfg.width);
  std::vector<std::vector<float>> dinput(n, std::vector<float>(NC, std::nanf("")));
  for (std::size_t s = n; s-- > 0;) {
    const float* dout = s + 1 == n ? nullptr : dinput[s + 1].data();
    float* din = s == 0 ? nullptr : dinput[s].data();
    chunk_backward(*out.chunks[s], *acts[s], dout, din);
  }
  return out;
}

}  // namespace

TEST_CASE("pipeline partitions reproduce the whole model's loss and gradients",
          "[model][pipeline]") {
  struct split {
    int layers, chunks;
  };
  const split sp = GENERATE(split{2, 2}, split{3, 3}, split{3, 2}, split{2, 1});
  INFO(sp.layers << " layers in " << sp.chunks << " chunks");
  const gpt_config cfg = tiny_config(sp.layers);
  const std::uint64_t seed = 1234;
  const micro_batch mb = make_batch(cfg, 2, 5, 11);

  gpt_chunk whole(cfg, chunk_range::whole(cfg));
  whole.init_gpt2(seed);
  whole.zero_grad();
  gpt_activations whole_acts(whole, 2, 5);
  const double whole_loss = model_backward(whole, whole_acts, mb).mean();

  const auto parts = partition_layers(cfg, sp.chunks);
  REQUIRE(int(parts.size()) == sp.chunks);
  pipeline_result pipe = run_pipeline(cfg, parts, mb, seed);

  CHECK(std::abs(pipe.loss - whole_loss) <= 1e-6 * std::abs(whole_loss));

  // Init determinism: each chunk's parameters equal the whole model's same-named ones exactly.
  std::set<std::string> seen;
  for (const auto& chunk : pipe.chunks) {
    for (const auto& p : chunk->parameters()) {
      INFO("parameter " << p.name);
      const auto mine = tensor_values(chunk->param(p.name));
      const auto ref = tensor_values(whole.param(p.name));
      REQUIRE(mine.size() == ref.size());
      CHECK(std::memcmp(mine.data(), ref.data(), mine.size() * sizeof(float)) == 0);
      if (p.name != "transformer.wte.weight") CHECK(seen.insert(p.name).second);
    }
  }
  // Together the chunks hold every parameter of the whole model.
  for (const auto& p : whole.parameters()) {
    if (p.name != "transformer.wte.weight") CHECK(seen.count(p.name) == 1);
  }

  // Gradients: every non-wte parameter matches; wte = first-chunk (embedding) gradient plus
  // last-chunk (head) gradient.
  for (const auto& p : whole.parameters()) {
    INFO("gradient of " << p.name);
    const auto ref = grad_values(whole, p.name);
    std::vector<float> sum(ref.size(), 0.0f);
    int holders = 0;
    for (const auto& chunk : pipe.chunks) {
      bool has = false;
      for (const auto& q : chunk->parameters()) has = has || q.name == p.name;
      if (!has) continue;
      ++holders;
      const auto g = grad_values(*chunk, p.name);
      for (std::size_t i = 0; i < g.size(); ++i) sum[i] += g[i];
    }
    CHECK(holders == (p.name == "transformer.wte.weight" && sp.chunks > 1 ? 2 : 1));
    CHECK(rel_diff(sum, ref) <= 1e-6);
  }
}

TEST_CASE("a chunk's dinput is overwritten, not accumulated", "[model][pipeline]") {
  const gpt_config cfg = tiny_config(2);
  const auto parts = partition_layers(cfg, 2);
  gpt_chunk first(cfg, parts[0]), last(cfg, parts[1]);
  first.init_gpt2(3);
  last.init_gpt2(3);
  const micro_batch mb = make_batch(cfg, 2, 5, 4);
  gpt_activations a0(first, 2, 5), a1(last, 2, 5);
  chunk_forward(first, a0, mb.tokens.data(), nullptr);
  chunk_forward(last, a1, nullptr, chunk_output(a0));
  chunk_loss_backward_start(last, a1, mb.targets.data(), 1.0f);
  std::vector<float> d1(2 * 5 * 8, 0.0f), d2(2 * 5 * 8, 1e6f);
  chunk_backward(last, a1, nullptr, d1.data());
  chunk_forward(last, a1, nullptr, chunk_output(a0));
  chunk_loss_backward_start(last, a1, mb.targets.data(), 1.0f);
  chunk_backward(last, a1, nullptr, d2.data());
  CHECK(rel_diff(d2, d1) == 0.0);
}

TEST_CASE("partition_layers splits evenly, remainder to earlier chunks", "[model][partition]") {
  auto sizes = [](const std::vector<chunk_range>& parts) {
    std::vector<int> out;
    for (const auto& p : parts) out.push_back(p.last_layer - p.first_layer);
    return out;
  };
  gpt_config c = tiny_config(7);
  CHECK(sizes(partition_layers(c, 1)) == std::vector<int>{7});
  CHECK(sizes(partition_layers(c, 2)) == std::vector<int>{4, 3});
  CHECK(sizes(partition_layers(c, 3)) == std::vector<int>{3, 2, 2});
  CHECK(sizes(partition_layers(c, 4)) == std::vector<int>{2, 2, 2, 1});
  CHECK(sizes(partition_layers(c, 7)) == std::vector<int>{1, 1, 1, 1, 1, 1, 1});
  c.layers = 6;
  CHECK(sizes(partition_layers(c, 3)) == std::vector<int>{2, 2, 2});
  c.layers = 8;
  CHECK(sizes(partition_layers(c, 3)) == std::vector<int>{3, 3, 2});

  for (int chunks = 1; chunks <= 8; ++chunks) {
    const auto parts = partition_layers(c, chunks);
    REQUIRE(int(parts.size()) == chunks);
    int next = 0;
    for (int s = 0; s < chunks; ++s) {
      const auto& p = parts[std::size_t(s)];
      CHECK(p.first_layer == next);
      CHECK(p.last_layer > p.first_layer);
      CHECK(p.embedding == (s == 0));
      CHECK(p.head == (s == chunks - 1));
      next = p.last_layer;
    }
    CHECK(next == c.layers);
  }

  CHECK_THROWS_AS(partition_layers(c, 0), std::invalid_argument);
  CHECK_THROWS_AS(partition_layers(c, -1), std::invalid_argument);
  CHECK_THROWS_AS(partition_layers(c, 9), std::invalid_argument);
  const std::string msg = error_message([&] { partition_layers(c, 9); });
  CHECK_THAT(msg, Catch::Contains("8") && Catch::Contains("9"));
}

TEST_CASE("gpt_config::validate names the offending key", "[model][config]") {
  auto msg_for = [](auto mutate) {
    gpt_config c = tiny_config();
    mutate(c);
    return error_message<std::invalid_argument>([&] { c.validate(); });
  };
  CHECK_NOTHROW(tiny_config().validate());
  CHECK_THAT(msg_for([](gpt_config& c) { c.width = 9; }), Catch::StartsWith("model.heads"));
  CHECK_THAT(msg_for([](gpt_config& c) { c.padded_vocab_size = 10; }),
             Catch::StartsWith("model.padded_vocab_size"));
  CHECK_THAT(msg_for([](gpt_config& c) { c.vocab_size = 0; }),
             Catch::StartsWith("model.vocab_size"));
  CHECK_THAT(msg_for([](gpt_config& c) { c.context = -1; }), Catch::StartsWith("model.context"));
  CHECK_THAT(msg_for([](gpt_config& c) { c.layers = 0; }), Catch::StartsWith("model.layers"));
  CHECK_THAT(msg_for([](gpt_config& c) { c.heads = 0; }), Catch::StartsWith("model.heads"));
  CHECK_THAT(msg_for([](gpt_config& c) { c.width = 0; }), Catch::StartsWith("model.width"));
  // A chunk of an invalid config is refused the same way.
  gpt_config bad = tiny_config();
  bad.heads = 3;
  CHECK_THROWS_WITH(gpt_chunk(bad, chunk_range::whole(bad)), Catch::Contains("model.heads"));
}

TEST_CASE("parameter layout: names, shapes, alignment, conv1d and decay flags", "[model]") {
  const gpt_config cfg = tiny_config(2);
  const auto layout = chunk_parameter_layout(cfg, chunk_range::whole(cfg));
  REQUIRE(layout.size() == 2 + 12 * 2 + 2);
  CHECK(layout.front().name == "transformer.wte.weight");
  CHECK(layout.front().shape == kernels::shape_t{16, 8});
  CHECK(layout[1].name == "transformer.wpe.weight");
  CHECK(layout[1].shape == kernels::shape_t{8, 8});
  CHECK(layout.back().name == "transformer.ln_f.bias");
  std::int64_t total = 0, end = 0;
  for (const auto& p : layout) {
    INFO(p.name);
    CHECK(p.offset % 16 == 0);
    CHECK(p.offset >= end);
    CHECK(p.numel == kernels::shape_numel(p.shape));
    end = p.offset + p.numel;
    total += p.numel;
    CHECK(p.decay == (p.shape.size() == 2));
    const bool conv = p.name.ends_with("c_attn.weight") || p.name.ends_with("c_proj.weight") ||
                      p.name.ends_with("c_fc.weight");
    CHECK(p.conv1d == conv);
  }
  CHECK(total == cfg.parameter_count());
  gpt_chunk s(cfg, chunk_range::whole(cfg));
  CHECK(s.parameter_count() == end);
  CHECK(s.param("transformer.h.1.mlp.c_fc.weight").shape() == kernels::shape_t{32, 8});
  CHECK(s.param("transformer.h.0.attn.c_attn.weight").shape() == kernels::shape_t{24, 8});
  CHECK_THROWS_WITH(s.param("transformer.h.2.ln_1.weight"),
                    Catch::Contains("transformer.h.2.ln_1.weight"));

  // A middle chunk has neither embedding nor head.
  const auto mid = chunk_parameter_layout(cfg, chunk_range{1, 2, false, false});
  CHECK(mid.size() == 12);
  CHECK(mid.front().name == "transformer.h.1.ln_1.weight");
  // A last chunk without the embedding still holds the tied wte (not wpe).
  const auto last = chunk_parameter_layout(cfg, chunk_range{1, 2, false, true});
  CHECK(last.front().name == "transformer.wte.weight");
  for (const auto& p : last) CHECK(p.name != "transformer.wpe.weight");
  CHECK_THROWS(chunk_parameter_layout(cfg, chunk_range{1, 3, false, true}));
}

TEST_CASE("GPT-2 init: deterministic, padded rows zero, biases 0, layernorm 1", "[model][init]") {
  const gpt_config cfg = tiny_config(2);
  gpt_chunk a(cfg, chunk_range::whole(cfg)), b(cfg, chunk_range::whole(cfg)),
      c(cfg, chunk_range::whole(cfg));
  a.init_gpt2(99);
  b.init_gpt2(99);
  c.init_gpt2(100);
  CHECK(snapshot_params(a) == snapshot_params(b));
  CHECK(snapshot_params(a) != snapshot_params(c));
  const auto wte = tensor_values(a.param("transformer.wte.weight"));
  for (std::size_t i = std::size_t(cfg.vocab_size) * cfg.width; i < wte.size(); ++i) {
    REQUIRE(wte[i] == 0.0f);
  }
  for (float v : tensor_values(a.param("transformer.h.0.ln_1.weight"))) CHECK(v == 1.0f);
  for (float v : tensor_values(a.param("transformer.h.1.attn.c_attn.bias"))) CHECK(v == 0.0f);
  // c_proj weights use the residual-scaled std 0.02 / sqrt(2 * layers).
  auto stddev = [](const std::vector<float>& v) {
    double s = 0;
    for (float x : v) s += double(x) * x;
    return std::sqrt(s / double(v.size()));
  };
  gpt_config big = cfg;
  big.width = 64;
  big.heads = 4;
  gpt_chunk g(big, chunk_range::whole(big));
  g.init_gpt2(7);
  CHECK(stddev(tensor_values(g.param("transformer.h.0.mlp.c_fc.weight"))) ==
        Approx(0.02).epsilon(0.05));
  CHECK(stddev(tensor_values(g.param("transformer.h.0.mlp.c_proj.weight"))) ==
        Approx(0.02 / std::sqrt(4.0)).epsilon(0.05));
}

TEST_CASE("gradients accumulate across backward passes", "[model][accumulation]") {
  const gpt_config cfg = tiny_config();
  gpt_chunk model(cfg, chunk_range::whole(cfg));
  model.init_gpt2(21);
  randomize_params(model, 8);
  const micro_batch mb1 = make_batch(cfg, 2, 5, 100), mb2 = make_batch(cfg, 2, 5, 200);
  gpt_activations acts(model, 2, 5);
  const auto n = static_cast<std::size_t>(model.parameter_count());

  model.zero_grad();
  const double l1 = model_backward(model, acts, mb1).mean();
  const std::vector<float> g1(model.grads(), model.grads() + n);
  model.zero_grad();
  const double l2 = model_backward(model, acts, mb2).mean();
  const std::vector<float> g2(model.grads(), model.grads() + n);

  SECTION("two micro-batches with grad_scale 0.5 give the average") {
    model.zero_grad();
    const double h1 = model_backward(model, acts, mb1, 0.5f).mean();
    const double h2 = model_backward(model, acts, mb2, 0.5f).mean();
    CHECK(h1 == l1);  // the reported loss is not scaled
    CHECK(h2 == l2);
    std::vector<float> avg(n);
    for (std::size_t i = 0; i < n; ++i) avg[i] = 0.5f * (g1[i] + g2[i]);
    const std::vector<float> acc(model.grads(), model.grads() + n);
    for (const auto& p : model.parameters()) {
      INFO(p.name);
      CHECK(rel_diff(acc.data() + p.offset, avg.data() + p.offset, p.numel) <= 1e-6);
    }
  }

  SECTION("backward twice without zero_grad doubles the gradient") {
    model.zero_grad();
    model_backward(model, acts, mb1);
    model_backward(model, acts, mb1);
    std::vector<float> twice(n);
    for (std::size_t i = 0; i < n; ++i) twice[i] = 2.0f * g1[i];
    CHECK(rel_diff(std::vector<float>(model.grads(), model.grads() + n), twice) <= 1e-6);
  }

  SECTION("gradients are added to whatever the buffer held") {
    for (std::size_t i = 0; i < n; ++i) model.grads()[i] = 0.125f;
    model_backward(model, acts, mb1);
    std::vector<float> expect(n);
    for (std::size_t i = 0; i < n; ++i) expect[i] = g1[i] + 0.125f;
    CHECK(rel_diff(std::vector<float>(model.grads(), model.grads() + n), expect) <= 1e-6);
  }

  SECTION("one batch of 2 rows == two 1-row micro-batches scaled by 0.5 (equal counts)") {
    // ignore_every 5 ignores positions 1 and 6: one target in each row of 5.
    const micro_batch both = make_batch(cfg, 2, 5, 300, 5);
    micro_batch row0{1,
                     5,
                     {both.tokens.begin(), both.tokens.begin() + 5},
                     {both.targets.begin(), both.targets.begin() + 5}};
    micro_batch row1{1,
                     5,
                     {both.tokens.begin() + 5, both.tokens.end()},
                     {both.targets.begin() + 5, both.targets.end()}};
    model.zero_grad();
    const auto whole = model_backward(model, acts, both);
    CHECK(whole.count == 8);
    const std::vector<float> gw(model.grads(), model.grads() + n);
    gpt_activations acts1(model, 1, 5);
    model.zero_grad();
    const auto r0 = model_backward(model, acts1, row0, 0.5f);
    const auto r1 = model_backward(model, acts1, row1, 0.5f);
    CHECK(r0.count == 4);
    CHECK(r1.count == 4);
    CHECK(0.5 * (r0.mean() + r1.mean()) == Approx(whole.mean()).epsilon(1e-6));
    for (const auto& p : model.parameters()) {
      INFO(p.name);
      CHECK(rel_diff(model.grads() + p.offset, gw.data() + p.offset, p.numel) <= 1e-5);
    }
  }
}

TEST_CASE("activations and call order are checked", "[model]") {
  const gpt_config cfg = tiny_config();
  gpt_chunk model(cfg, chunk_range::whole(cfg));
  model.init_gpt2(1);
  CHECK_THROWS_AS(gpt_activations(model, 1, cfg.context + 1), std::invalid_argument);
  CHECK_THROWS_AS(gpt_activations(model, 0, 4), std::invalid_argument);
  CHECK_NOTHROW(gpt_activations(model, 1, cfg.context));
  gpt_activations acts(model, 1, 4);
  const micro_batch mb = make_batch(cfg, 1, 4, 1);
  chunk_forward(model, acts, mb.tokens.data(), nullptr);
  // Backward needs the loss gradient first.
  CHECK_THROWS_AS(chunk_backward(model, acts, nullptr, nullptr), std::logic_error);
  chunk_loss_backward_start(model, acts, mb.targets.data(), 1.0f);
  // The logits now hold gradients: no second loss until the next forward.
  CHECK_THROWS_AS(chunk_loss(model, acts, mb.targets.data()), std::logic_error);
  CHECK_THROWS_AS(chunk_loss_backward_start(model, acts, mb.targets.data(), 1.0f),
                  std::logic_error);
  // A chunk without the head cannot produce a loss.
  const auto parts = partition_layers(cfg, 2);
  gpt_chunk first(cfg, parts[0]);
  gpt_activations a0(first, 1, 4);
  chunk_forward(first, a0, mb.tokens.data(), nullptr);
  CHECK_THROWS_AS(chunk_loss(first, a0, mb.targets.data()), std::logic_error);
}
