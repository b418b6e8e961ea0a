// Tensor parallelism in the engine (engine/chunks/tensor_group.hpp): t shards of a stage, each in a
// thread with its member of an in-process group, against the unsharded stage. Loss and
// gradients (the shards' slices put back together) agree within float rounding of the
// reordered sums; replicated parameters' gradients are bitwise equal on every shard; split
// backward and checkpointing keep their bitwise promises on shards; the group's deadline and
// abort end every wait.
#include <atomic>
#include <exception>
#include <thread>

#include "engine/chunks/tensor_group.hpp"
#include "tests/engine/engine_test_util.hpp"

namespace troupe::engine {
namespace {

using test::error_message;
using test::make_batch;
using test::micro_batch;
using test::randomize_params;
using test::relative_difference;

// vocab 30 (padded 32), context 8, 2 layers, 4 heads, width 16.
gpt_config tp_config() {
  gpt_config c;
  c.vocab_size = 30;
  c.padded_vocab_size = 32;
  c.context = 8;
  c.layers = 2;
  c.heads = 4;
  c.width = 16;
  return c;
}

struct run_options {
  int tp = 1;
  int stages = 1;  // a pipeline of this many stages, run one after the other in each shard
  bool recompute = false;
  bool split = false;  // B then W
};

// One shard's results: the loss, and its stages' parameter and gradient buffers.
struct shard_result {
  double loss = 0;
  std::vector<std::vector<float>> params, grads;  // by stage
  std::vector<float> dinput_last;                 // the last stage's input gradient (stages > 1)
};

struct run_result {
  std::vector<shard_result> shards;
  std::vector<std::vector<parameter_info>> layouts;  // shard layouts by stage
  std::vector<chunk_range> ranges;
};

// The whole model's parameters, randomised (keyed by name, so every layout agrees).
gpt_chunk whole_model(const gpt_config& c) {
  gpt_chunk whole(c, chunk_range::whole(c));
  randomize_params(whole, 11);
  return whole;
}

shard_result run_shard(const gpt_config& c, const run_options& o, const gpt_chunk& whole,
                       std::shared_ptr<tensor_group> group, const micro_batch& mb) {
  const tensor_shard shard{group ? group->rank() : 0, o.tp};
  const auto ranges = partition_layers(c, o.stages);
  std::vector<std::unique_ptr<gpt_chunk>> stages;
  std::vector<std::unique_ptr<gpt_activations>> acts;
  for (const auto& r : ranges) {
    stages.push_back(std::make_unique<gpt_chunk>(c, r, shard));
    auto& st = *stages.back();
    if (group) st.set_tensor_group(group);
    for (const auto& p : st.parameters())
      take_shard(p, shard, whole.params() + whole.parameter(p.name).offset, st.params() + p.offset);
    auto scratch = o.recompute ? std::make_shared<block_scratch>(c, mb.B, mb.T, o.tp) : nullptr;
    acts.push_back(std::make_unique<gpt_activations>(st, mb.B, mb.T, scratch));
  }
  const std::size_t S = stages.size();
  for (std::size_t s = 0; s < S; ++s) {
    const float* input = s == 0 ? nullptr : chunk_output(*acts[s - 1]);
    chunk_forward(*stages[s], *acts[s], mb.tokens.data(), input);
  }
  shard_result out;
  out.loss =
      chunk_loss_backward_start(*stages[S - 1], *acts[S - 1], mb.targets.data(), 1.0f).mean();
  const std::size_t NC = static_cast<std::size_t>(mb.B * mb.T * c.width);
  std::vector<std::vector<float>> dinput(S, std::vector<float>(NC));
  for (std::size_t s = S; s-- > 0;) {
    const float* dout = s + 1 < S ? dinput[s + 1].data() : nullptr;
    float* din = s > 0 ? dinput[s].data() : nullptr;
    if (o.split) {
      chunk_backward_input(*stages[s], *acts[s], dout, din);
      chunk_backward_weight(*stages[s], *acts[s]);
    } else {
      chunk_backward(*stages[s], *acts[s], dout, din);
    }
  }
  for (const auto& st : stages) {
    out.params.push_back(test::snapshot_params(*st));
    out.grads.emplace_back(st->grads(), st->grads() + st->parameter_count());
  }
  if (S > 1) out.dinput_last = dinput[S - 1];
  return out;
}

run_result run(const gpt_config& c, const run_options& o, const micro_batch& mb) {
  const gpt_chunk whole = whole_model(c);
  run_result res;
  res.ranges = partition_layers(c, o.stages);
  for (const auto& r : res.ranges) res.layouts.push_back(chunk_parameter_layout(c, r, {0, o.tp}));
  res.shards.resize(static_cast<std::size_t>(o.tp));
  if (o.tp == 1) {
    res.shards[0] = run_shard(c, o, whole, nullptr, mb);
    return res;
  }
  auto group = make_local_tensor_group(o.tp, "test tp group", std::chrono::seconds(60));
  std::vector<std::exception_ptr> errors(static_cast<std::size_t>(o.tp));
  std::vector<std::thread> threads;
  for (int r = 0; r < o.tp; ++r) {
    threads.emplace_back([&, r] {
      const auto i = static_cast<std::size_t>(r);
      try {
        res.shards[i] = run_shard(c, o, whole, group[i], mb);
      } catch (...) {
        errors[i] = std::current_exception();
        group[i]->abort("shard " + std::to_string(r) + " failed");
      }
    });
  }
  for (auto& t : threads) t.join();
  for (auto& e : errors)
    if (e) std::rethrow_exception(e);
  return res;
}

// The shards' slices of stage s's buffer (params or grads) put back into the whole layout.
std::vector<float> gathered(const gpt_config& c, const run_result& res, std::size_t s, bool grads) {
  const auto whole_layout = chunk_parameter_layout(c, res.ranges[s]);
  std::vector<float> out(
      static_cast<std::size_t>(whole_layout.back().offset + whole_layout.back().numel), 0.0f);
  const int t = static_cast<int>(res.shards.size());
  for (int r = 0; r < t; ++r) {
    const auto& buf = grads ? res.shards[static_cast<std::size_t>(r)].grads[s]
                            : res.shards[static_cast<std::size_t>(r)].params[s];
    const auto layout = chunk_parameter_layout(c, res.ranges[s], {r, t});
    for (std::size_t i = 0; i < layout.size(); ++i)
      put_shard(layout[i], {r, t}, buf.data() + layout[i].offset,
                out.data() + whole_layout[i].offset);
  }
  return out;
}

TEST_CASE("tensor shards' parameter slices tile the whole tensor", "[tensor_parallel]") {
  const gpt_config c = tp_config();
  const int t = GENERATE(2, 4);
  const gpt_chunk whole = whole_model(c);
  const auto whole_layout = whole.parameters();
  std::vector<float> rebuilt(static_cast<std::size_t>(whole.parameter_count()), -7.0f);
  std::int64_t shard_floats = 0;
  for (int r = 0; r < t; ++r) {
    gpt_chunk shard(c, chunk_range::whole(c), {r, t});
    REQUIRE(shard.parameters().size() == whole_layout.size());
    for (std::size_t i = 0; i < whole_layout.size(); ++i) {
      const auto& p = shard.parameters()[i];
      const auto& w = whole_layout[i];
      INFO(p.name);
      CHECK(p.full_shape == w.shape);
      if (p.split == tensor_split::replicated) {
        CHECK(p.shape == w.shape);
      } else {
        CHECK(p.numel * t == w.numel);
        shard_floats += p.numel;
      }
      std::vector<float> slice(static_cast<std::size_t>(p.numel));
      take_shard(p, {r, t}, whole.params() + w.offset, slice.data());
      put_shard(p, {r, t}, slice.data(), rebuilt.data() + w.offset);
    }
  }
  for (const auto& w : whole_layout) {
    INFO(w.name);
    CHECK(std::equal(whole.params() + w.offset, whole.params() + w.offset + w.numel,
                     rebuilt.data() + w.offset));
  }
  // Split: wte, and per layer c_attn (weight, bias), attn.c_proj.weight, c_fc (weight, bias),
  // mlp.c_proj.weight.
  const std::int64_t C = c.width;
  CHECK(shard_floats == std::int64_t{c.padded_vocab_size} * C +
                            c.layers * (3 * C * C + 3 * C + C * C + 4 * C * C + 4 * C + 4 * C * C));
  // The q, k and v of a shard's heads: the rows of head h of q are rows h*hs.. of the whole.
  gpt_chunk s1(c, chunk_range::whole(c), {1, t});
  s1.init_gpt2(5);
  gpt_chunk w(c, chunk_range::whole(c));
  w.init_gpt2(5);
  const auto& pa = s1.parameter("transformer.h.0.attn.c_attn.weight");
  const std::int64_t rows = 3 * C / t;
  CHECK(pa.shape == kernels::shape_t{rows, C});
  const float* k_whole = w.params() + w.parameter("transformer.h.0.attn.c_attn.weight").offset +
                         (C + C / t) * C;  // k rows of shard 1
  const float* k_shard = s1.params() + pa.offset + (C / t) * C;
  CHECK(std::equal(k_shard, k_shard + (C / t) * C, k_whole));
}

TEST_CASE("GPT-2 init of a tensor shard is the slice of the whole model's init",
          "[tensor_parallel]") {
  const gpt_config c = tp_config();
  gpt_chunk whole(c, chunk_range::whole(c));
  whole.init_gpt2(42);
  for (int r = 0; r < 4; ++r) {
    gpt_chunk shard(c, chunk_range::whole(c), {r, 4});
    shard.init_gpt2(42);
    for (const auto& p : shard.parameters()) {
      INFO(p.name << " shard " << r);
      std::vector<float> want(static_cast<std::size_t>(p.numel));
      take_shard(p, {r, 4}, whole.params() + whole.parameter(p.name).offset, want.data());
      CHECK(std::equal(want.begin(), want.end(), shard.params() + p.offset));
    }
  }
}

TEST_CASE("tensor-parallel shards give the whole model's loss and gradients", "[tensor_parallel]") {
  const gpt_config c = tp_config();
  const int t = GENERATE(2, 4);
  const int stages = GENERATE(1, 2);
  INFO("tp " << t << ", " << stages << " pipeline stages");
  const micro_batch mb = make_batch(c, 2, 6, 99);
  const run_result serial = run(c, {1, stages}, mb);
  const run_result tp = run(c, {t, stages}, mb);
  const double loss = serial.shards[0].loss;
  for (const auto& s : tp.shards) CHECK(s.loss == tp.shards[0].loss);  // every shard's the same
  CHECK(std::abs(tp.shards[0].loss - loss) <= 1e-5 * std::abs(loss));
  for (std::size_t s = 0; s < tp.ranges.size(); ++s) {
    INFO("stage " << s);
    const auto g = gathered(c, tp, s, true);
    const double diff = relative_difference(g, serial.shards[0].grads[s]);
    INFO("gradient relative difference " << diff);
    CHECK(diff < 1e-5);
    // Replicated parameters: bitwise the same gradient on every shard.
    for (const auto& p : tp.layouts[s]) {
      if (p.split != tensor_split::replicated) continue;
      INFO(p.name);
      for (std::size_t r = 1; r < tp.shards.size(); ++r)
        CHECK(std::equal(tp.shards[r].grads[s].begin() + p.offset,
                         tp.shards[r].grads[s].begin() + p.offset + p.numel,
                         tp.shards[0].grads[s].begin() + p.offset));
    }
    if (s + 1 == tp.ranges.size() && s > 0) {  // the gradient sent to the previous stage
      CHECK(relative_difference(tp.shards[0].dinput_last, serial.shards[0].dinput_last) < 1e-5);
      for (const auto& sh : tp.shards) CHECK(sh.dinput_last == tp.shards[0].dinput_last);
    }
  }
  // The loss is that of the whole model, not of a slice: a sanity anchor against a model
  // that ignores some shards' vocabulary.
  CHECK(loss > 1.0);
}

TEST_CASE("on tensor shards, split backward and checkpointing keep their bitwise promises",
          "[tensor_parallel]") {
  const gpt_config c = tp_config();
  const micro_batch mb = make_batch(c, 2, 6, 7);
  const run_result plain = run(c, {2, 2}, mb);
  for (const auto& [recompute, split] : {std::pair{true, false}, {false, true}, {true, true}}) {
    INFO((recompute ? "checkpointed" : "saved") << (split ? ", B then W" : ", whole backward"));
    const run_result other = run(c, {2, 2, recompute, split}, mb);
    for (std::size_t r = 0; r < 2; ++r) {
      CHECK(other.shards[r].loss == plain.shards[r].loss);
      CHECK(other.shards[r].grads == plain.shards[r].grads);
    }
  }
}

TEST_CASE("activation bytes of a tensor shard are what it holds", "[tensor_parallel]") {
  const gpt_config c = tp_config();
  const micro_batch mb = make_batch(c, 2, 6, 3);
  for (const bool split : {false, true}) {
    gpt_chunk st(c, chunk_range::whole(c), {0, 2});
    // A shard of 2 computed alone is wrong arithmetic, but holds exactly its shard's buffers.
    struct half final : tensor_group {
      int rank() const override { return 0; }
      int size() const override { return 2; }
      void all_reduce_sum(std::span<float>) override {}
      void all_reduce_sum(std::span<double>) override {}
      void all_reduce_max(std::span<float>) override {}
      void abort(const std::string&) override {}
    };
    st.set_tensor_group(std::make_shared<half>());
    randomize_params(st, 1);
    gpt_activations acts(st, 2, 6);
    chunk_forward(st, acts, mb.tokens.data(), nullptr);
    chunk_loss_backward_start(st, acts, mb.targets.data(), 1.0f);
    if (split) {
      chunk_backward_input(st, acts, nullptr, nullptr);
      chunk_backward_weight(st, acts);
    } else {
      chunk_backward(st, acts, nullptr, nullptr);
    }
    CHECK(acts.bytes() == activation_bytes(c, st.range(), 2, 6, false, split, 2));
    CHECK(activation_bytes(c, st.range(), 2, 6, false, split, 2) <
          activation_bytes(c, st.range(), 2, 6, false, split, 1));
  }
  CHECK(block_scratch(c, 2, 6, 2).bytes() == block_scratch_bytes(c, 2, 6, 2));
}

TEST_CASE("a model that cannot be split t ways is refused naming parallel.tp",
          "[tensor_parallel]") {
  const gpt_config c = tp_config();
  CHECK(error_message<std::invalid_argument>([&] {
          check_tensor_parallel(c, 3);
        }).starts_with("parallel.tp: 4 heads (model.heads) do not split into 3"));
  gpt_config odd = c;
  odd.heads = 8;
  odd.padded_vocab_size = 36;
  CHECK(error_message<std::invalid_argument>([&] {
          check_tensor_parallel(odd, 8);
        }).find("model.padded_vocab_size") != std::string::npos);
  CHECK(error_message<std::logic_error>([&] {
          gpt_chunk st(c, chunk_range::whole(c), {0, 2});
          gpt_activations acts(st, 1, 4);
          const std::vector<std::int32_t> tokens(4, 1);
          chunk_forward(st, acts, tokens.data(), nullptr);
        }).find("has no tensor-parallel group") != std::string::npos);
}

TEST_CASE("a tensor group's collectives agree bitwise, and every wait ends", "[tensor_parallel]") {
  SECTION("sum in member order, max, on every member") {
    auto g = make_local_tensor_group(3, "g");
    std::vector<std::vector<float>> data{{1e8f, 1, 2}, {1, -1e8f, 3}, {0.5f, 0.25f, -4}};
    std::vector<std::vector<float>> maxes{{1, 5}, {7, -2}, {3, 3}};
    std::vector<std::thread> ts;
    for (int r = 0; r < 3; ++r)
      ts.emplace_back([&, r] {
        g[static_cast<std::size_t>(r)]->all_reduce_sum(data[static_cast<std::size_t>(r)]);
        g[static_cast<std::size_t>(r)]->all_reduce_max(maxes[static_cast<std::size_t>(r)]);
      });
    for (auto& t : ts) t.join();
    const float s0 = (1e8f + 1.0f) + 0.5f;  // member order: (m0 + m1) + m2
    for (int r = 0; r < 3; ++r) {
      CHECK(data[static_cast<std::size_t>(r)] == std::vector<float>{s0, (1 - 1e8f) + 0.25f, 1.0f});
      CHECK(maxes[static_cast<std::size_t>(r)] == std::vector<float>{7, 5});
    }
  }
  SECTION("a member that never comes: the deadline names it") {
    auto g = make_local_tensor_group(2, "tp group of stage 1", std::chrono::milliseconds(200));
    std::vector<float> v{1};
    const auto msg = error_message<tensor_group_error>([&] { g[0]->all_reduce_sum(v); });
    CHECK(msg.starts_with("tp group of stage 1: member 0 waited 200 ms for member 1"));
    // The group stays failed: the late member does not hang either.
    CHECK(error_message<tensor_group_error>([&] { g[1]->all_reduce_sum(v); }) == msg);
  }
  SECTION("an abort wakes a waiting member") {
    auto g = make_local_tensor_group(2, "g", std::chrono::seconds(60));
    std::string msg;
    std::thread waiter([&] {
      std::vector<float> v{1};
      msg = error_message<tensor_group_error>([&] { g[0]->all_reduce_sum(v); });
    });
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    g[1]->abort("shard 1 failed: out of memory");
    waiter.join();
    CHECK(msg == "g: shard 1 failed: out of memory");
  }
  SECTION("buffers of different lengths are a bug, reported to both") {
    auto g = make_local_tensor_group(2, "g", std::chrono::seconds(60));
    std::string m0, m1;
    std::thread a([&] {
      std::vector<float> v(3);
      m0 = error_message<tensor_group_error>([&] { g[0]->all_reduce_sum(v); });
    });
    std::vector<float> w(4);
    m1 = error_message<tensor_group_error>([&] { g[1]->all_reduce_sum(w); });
    a.join();
    CHECK(m0.find("different lengths") != std::string::npos);
    CHECK(m1.find("different lengths") != std::string::npos);
  }
}

}  // namespace
}  // namespace troupe::engine
