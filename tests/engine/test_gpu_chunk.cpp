// GPU pipeline chunks (`gpu` suite; exit 77, SKIP, without a device): two chunks of the model on
// one device, driven in a two-stage 1F1B order with two micro-batches in flight, give bitwise
// the whole model's losses, gradients and updated weights (the tied wte, whose two copies'
// gradients are summed in another order, within rounding), with and without activation
// checkpointing; every chunk allocates exactly what plan_gpu_chunk_memory says; misuse is refused.
#include <cuda_runtime_api.h>
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <vector>

#include "engine/chunks/gpu_chunk.hpp"
#include "engine/model/gpt_model.hpp"
#include "engine/model/random.hpp"
#include "engine/training/gpu_trainer.hpp"
#include "engine/training/optimizer.hpp"
#include "kernels/cuda/activation_link.hpp"
#include "tests/engine/engine_test_util.hpp"

using namespace troupe::engine;
using troupe::engine::test::relative_difference;

namespace {

const gpt_config kConfig{97, 128, 64, 4, 4, 64};  // 4 layers, head size 16
constexpr int kB = 2, kT = 40, kMicroBatches = 4;

using batch = troupe::engine::test::token_batch;

batch make_batch(std::uint64_t salt) {
  return troupe::engine::test::gpu_test_batch(salt, kB, kT, kConfig.vocab_size);
}

void cuda_ok(cudaError_t e) { REQUIRE(e == cudaSuccess); }

// Moves `bytes` from src (on `from`'s stream) to dst (on `to`'s stream), finished on return.
void transfer(const gpu_chunk& from, const void* src, const gpu_chunk& to, void* dst,
              std::size_t bytes) {
  from.synchronize();
  cuda_ok(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice,
                          static_cast<cudaStream_t>(to.stream())));
  to.synchronize();
}

const parameter_info& wte_of(const std::vector<parameter_info>& layout) {
  for (const auto& p : layout)
    if (p.name == "transformer.wte.weight") return p;
  throw std::logic_error("no wte");
}

// The parameter named in `layout` (a chunk's) as a slice of values laid out as `layout`.
std::vector<float> slice(const std::vector<float>& values, const parameter_info& p) {
  return {values.begin() + p.offset, values.begin() + p.offset + p.numel};
}

std::vector<float> slice_of(const std::vector<float>& whole_values,
                            const std::vector<parameter_info>& whole_layout,
                            const std::string& name) {
  for (const auto& p : whole_layout)
    if (p.name == name) return slice(whole_values, p);
  throw std::logic_error("no " + name);
}

struct pipeline_result {
  std::vector<double> losses;                     // per micro-batch, per step
  std::vector<std::vector<float>> grads, params;  // per chunk, after the last step
  double grad_norm = 0;                           // of the last step
};

struct device_buffer {
  void* p = nullptr;
  explicit device_buffer(std::size_t bytes) { cuda_ok(cudaMalloc(&p, bytes)); }
  ~device_buffer() { cudaFree(p); }
  device_buffer(const device_buffer&) = delete;
  device_buffer& operator=(const device_buffer&) = delete;
};

// How activations and gradients cross between the chunks: copied with the host waiting on
// both streams, or through local activation links ordered by events alone.
enum class crossing { host_synchronized, links };

// Two chunks, two slots each, on device 0: each step runs kMicroBatches micro-batches in the
// two-stage 1F1B order (stage 0: F0 F1 B0 F2 B1 F3 B2 B3), then sums the tied wte gradients,
// takes the global norm (wte once) and updates both chunks.
pipeline_result run_pipeline(const gpu_trainer_options& options, int steps,
                             crossing how = crossing::host_synchronized) {
  const auto ranges = partition_layers(kConfig, 2);
  gpt_chunk host0(kConfig, ranges[0]), host1(kConfig, ranges[1]);
  host0.init_gpt2(11);
  host1.init_gpt2(11);
  gpu_chunk first(host0, kB, kT, options, 2), last(host1, kB, kT, options, 2);
  const std::size_t bytes = first.activation_bytes();
  REQUIRE(bytes == last.activation_bytes());
  const auto& wte0 = wte_of(first.layout());
  const auto& wte1 = wte_of(last.layout());
  REQUIRE(wte0.numel == wte1.numel);
  // The links: activations forward, gradients back; the first chunk receives its output's
  // gradient into a buffer of its own.
  auto activations = troupe::kernels::cuda::make_local_link(0, 0);
  auto gradients = troupe::kernels::cuda::make_local_link(0, 0);
  device_buffer doutput(bytes);
  optimizer_config oc;
  oc.warmup_steps = 1;
  pipeline_result r;
  for (int step = 0; step < steps; ++step) {
    first.zero_grad();
    last.zero_grad();
    std::vector<batch> batches;
    for (int mb = 0; mb < kMicroBatches; ++mb)
      batches.push_back(make_batch(static_cast<std::uint64_t>(step * 100 + mb)));
    auto forward = [&](int mb) {
      const int slot = mb % 2;
      first.forward(slot, batches[static_cast<std::size_t>(mb)].inputs.data(), nullptr);
      if (how == crossing::links) {
        first.wait_event(activations->send(first.output(slot), bytes,
                                           static_cast<cudaEvent_t>(first.record_event())));
        last.wait_event(activations->receive(last.input(slot), bytes,
                                             static_cast<cudaEvent_t>(last.record_event())));
      } else {
        transfer(first, first.output(slot), last, last.input(slot), bytes);
      }
      r.losses.push_back(
          last.forward(slot, nullptr, batches[static_cast<std::size_t>(mb)].targets.data()));
    };
    auto backward = [&](int mb) {
      const int slot = mb % 2;
      const void* dinput = last.backward(slot, nullptr);
      REQUIRE(dinput != nullptr);
      if (how == crossing::links) {
        // The last chunk's next backward overwrites dinput only once the link released it.
        last.wait_event(
            gradients->send(dinput, bytes, static_cast<cudaEvent_t>(last.record_event())));
        first.wait_event(
            gradients->receive(doutput.p, bytes, static_cast<cudaEvent_t>(first.record_event())));
        CHECK(first.backward(slot, doutput.p) == nullptr);
      } else {
        last.synchronize();
        CHECK(first.backward(slot, dinput) == nullptr);
        first.synchronize();
      }
    };
    forward(0);
    forward(1);
    for (int mb = 0; mb < kMicroBatches; ++mb) {
      backward(mb);
      if (mb + 2 < kMicroBatches) forward(mb + 2);
    }
    // The tied wte: both copies receive the sum of their gradients.
    auto g0 = first.gradients(), g1 = last.gradients();
    for (std::int64_t i = 0; i < wte0.numel; ++i)
      g0[static_cast<std::size_t>(wte0.offset + i)] +=
          g1[static_cast<std::size_t>(wte1.offset + i)];
    cuda_ok(cudaMemcpy(first.device_gradients() + wte0.offset, g0.data() + wte0.offset,
                       static_cast<std::size_t>(wte0.numel) * sizeof(float),
                       cudaMemcpyHostToDevice));
    cuda_ok(cudaMemcpy(last.device_gradients() + wte1.offset, g0.data() + wte0.offset,
                       static_cast<std::size_t>(wte1.numel) * sizeof(float),
                       cudaMemcpyHostToDevice));
    cuda_ok(cudaDeviceSynchronize());  // the uploads landed before the chunks' streams read them
    r.grad_norm = std::sqrt(first.grad_square_sum() + last.grad_square_sum(false));
    const double lr = learning_rate(oc, step, steps);
    const auto multiplier = static_cast<float>(clip_coefficient(r.grad_norm, oc.grad_clip));
    first.adamw(adamw_hparams_at(oc, lr), step + 1, multiplier);
    last.adamw(adamw_hparams_at(oc, lr), step + 1, multiplier);
    if (step + 1 == steps) r.grads = {first.gradients(), last.gradients()};
  }
  r.params = {first.parameters(), last.parameters()};
  // The two copies of wte stay equal.
  CHECK(slice(r.params[0], wte0) == slice(r.params[1], wte1));
  return r;
}

// The whole model as one chunk over the same micro-batches, in micro-batch order.
pipeline_result run_whole(const gpu_trainer_options& options, int steps,
                          std::vector<parameter_info>& layout) {
  gpt_chunk host(kConfig, chunk_range::whole(kConfig));
  host.init_gpt2(11);
  gpu_trainer whole(host, kB, kT, options);
  layout = whole.layout();
  optimizer_config oc;
  oc.warmup_steps = 1;
  pipeline_result r;
  for (int step = 0; step < steps; ++step) {
    whole.zero_grad();
    for (int mb = 0; mb < kMicroBatches; ++mb) {
      const auto b = make_batch(static_cast<std::uint64_t>(step * 100 + mb));
      r.losses.push_back(whole.forward_backward(b.inputs.data(), b.targets.data()));
    }
    r.grad_norm = std::sqrt(whole.grad_square_sum());
    whole.update(oc, step, steps, clip_coefficient(r.grad_norm, oc.grad_clip));
    if (step + 1 == steps) r.grads = {whole.gradients()};
  }
  r.params = {whole.parameters()};
  return r;
}

// Every parameter of the chunks against the whole model's: bitwise, but wte within `wte_tol`.
void compare_chunks(const pipeline_result& chunks, const pipeline_result& whole,
                    const std::vector<parameter_info>& whole_layout,
                    const std::vector<std::vector<parameter_info>>& layouts, double wte_tol,
                    bool grads) {
  for (std::size_t c = 0; c < layouts.size(); ++c) {
    for (const auto& p : layouts[c]) {
      INFO("chunk " << c << " " << p.name << (grads ? " gradient" : " weight"));
      const auto mine = slice(grads ? chunks.grads[c] : chunks.params[c], p);
      const auto theirs = slice_of(grads ? whole.grads[0] : whole.params[0], whole_layout, p.name);
      if (p.name == "transformer.wte.weight")
        CHECK(relative_difference(mine, theirs) <= wte_tol);
      else
        CHECK(mine == theirs);
    }
  }
}

std::vector<std::vector<parameter_info>> chunk_layouts() {
  const auto ranges = partition_layers(kConfig, 2);
  return {chunk_parameter_layout(kConfig, ranges[0]), chunk_parameter_layout(kConfig, ranges[1])};
}

}  // namespace

TEST_CASE("two GPU chunks in a 1F1B order give the whole model's numbers", "[gpu][stage]") {
  for (auto dtype : {compute_dtype::fp32, compute_dtype::bf16}) {
    INFO("dtype " << compute_dtype_name(dtype));
    std::vector<parameter_info> whole_layout;
    // One step: bitwise. The head's loss of every micro-batch (the same kernels on the same
    // bits), the gradients but the tied wte's (its two halves summed in another order), and the
    // updated weights the same way.
    const auto whole = run_whole({dtype, false}, 1, whole_layout);
    const auto piped = run_pipeline({dtype, false}, 1);
    CHECK(piped.losses == whole.losses);
    compare_chunks(piped, whole, whole_layout, chunk_layouts(), 1e-5, true);
    compare_chunks(piped, whole, whole_layout, chunk_layouts(), 1e-5, false);
    CHECK(std::abs(piped.grad_norm - whole.grad_norm) <= 1e-6 * whole.grad_norm);
    // Later steps start from wte weights that differ in their last bits: within rounding.
    const auto whole3 = run_whole({dtype, false}, 3, whole_layout);
    const auto piped3 = run_pipeline({dtype, false}, 3);
    REQUIRE(piped3.losses.size() == whole3.losses.size());
    const double tol = dtype == compute_dtype::fp32 ? 1e-5 : 2e-2;
    for (std::size_t i = 0; i < whole3.losses.size(); ++i)
      CHECK(std::abs(piped3.losses[i] - whole3.losses[i]) <= tol * std::abs(whole3.losses[i]));
  }
}

TEST_CASE("GPU chunks with activation checkpointing and two slots change no bit", "[gpu][stage]") {
  for (auto dtype : {compute_dtype::fp32, compute_dtype::bf16, compute_dtype::fp16}) {
    INFO("dtype " << compute_dtype_name(dtype));
    const auto plain = run_pipeline({dtype, false}, 2);
    const auto recomputed = run_pipeline({dtype, true}, 2);
    CHECK(recomputed.losses == plain.losses);
    CHECK(recomputed.grads == plain.grads);
    CHECK(recomputed.params == plain.params);
  }
}

TEST_CASE("GPU chunks joined by activation links, ordered by events alone, change no bit",
          "[gpu][stage]") {
  for (auto dtype : {compute_dtype::fp32, compute_dtype::bf16}) {
    INFO("dtype " << compute_dtype_name(dtype));
    const auto synchronized = run_pipeline({dtype, false}, 2, crossing::host_synchronized);
    const auto linked = run_pipeline({dtype, true}, 2, crossing::links);
    CHECK(linked.losses == synchronized.losses);
    CHECK(linked.grads == synchronized.grads);
    CHECK(linked.params == synchronized.params);
  }
}

TEST_CASE("a GPU chunk allocates exactly its memory plan", "[gpu][stage]") {
  const auto ranges = partition_layers(kConfig, 2);
  for (auto dtype : {compute_dtype::fp32, compute_dtype::bf16}) {
    for (bool recompute : {false, true}) {
      for (int slots : {1, 3}) {
        for (const auto& range :
             {ranges[0], ranges[1], chunk_range::whole(kConfig), chunk_range{1, 3, false, false}}) {
          INFO(compute_dtype_name(dtype)
               << " recompute " << recompute << " slots " << slots << " layers ["
               << range.first_layer << ", " << range.last_layer << ") embedding " << range.embedding
               << " head " << range.head);
          gpt_chunk host(kConfig, range);
          host.init_gpt2(1);
          gpu_chunk chunk(host, kB, kT, {dtype, recompute}, slots);
          CHECK(chunk.device_bytes() ==
                plan_gpu_chunk_memory(kConfig, range, kB, kT, {dtype, recompute}, slots).total());
        }
      }
    }
  }
}

TEST_CASE("a GPU chunk refuses misuse, naming it", "[gpu][stage]") {
  const auto ranges = partition_layers(kConfig, 2);
  gpt_chunk host0(kConfig, ranges[0]), host1(kConfig, ranges[1]);
  host0.init_gpt2(1);
  host1.init_gpt2(1);
  gpu_chunk first(host0, kB, kT, {}, 2), last(host1, kB, kT, {}, 2);
  const auto b = make_batch(1);
  CHECK_THROWS_WITH(first.forward(2, b.inputs.data(), nullptr), Catch::Contains("slot 2"));
  CHECK_THROWS_WITH(first.input(0), Catch::Contains("takes tokens"));
  CHECK_THROWS_WITH(first.forward(0, nullptr, nullptr), Catch::Contains("needs tokens"));
  CHECK_THROWS_WITH(last.forward(0, nullptr, nullptr), Catch::Contains("needs targets"));
  CHECK_THROWS_WITH(last.output(0), Catch::Contains("no output"));
  first.forward(0, b.inputs.data(), nullptr);
  CHECK_THROWS_WITH(first.backward(0, nullptr), Catch::Contains("output's gradient"));
  gpt_chunk wrong(kConfig, ranges[1]);
  CHECK_THROWS_WITH(first.copy_parameters_to(wrong), Catch::Contains("different range"));
  CHECK_THROWS_WITH(gpu_chunk(host0, kB, kT, {}, 0), Catch::Contains("0 slots"));
  CHECK_THROWS_WITH(gpu_chunk(host0, kB, kT, {}, 1, 99), Catch::Contains("device 99"));
}

// ZeRO-3 drives a chunk's passes piece by piece (gathering between them): the passes stop where
// pass_stops says, and run that way give bitwise the whole calls' loss, input gradient and
// weight gradients, also with activation checkpointing and a split backward.
TEST_CASE("a GPU chunk's passes stop before each piece reading parameters, changing no bit",
          "[gpu][stage]") {
  const auto ranges = partition_layers(kConfig, 2);
  for (const bool recompute : {false, true})
    for (int c = 0; c < 2; ++c) {
      INFO("chunk " << c << (recompute ? ", checkpointing" : ""));
      gpt_chunk host(kConfig, ranges[static_cast<std::size_t>(c)]);
      host.init_gpt2(13);
      gpu_trainer_options options{compute_dtype::bf16, recompute};
      options.split_backward = true;
      gpu_chunk whole(host, kB, kT, options, 1), pieces(host, kB, kT, options, 1);
      const auto b = make_batch(5);
      const bool head = host.range().head;
      const std::size_t bytes = whole.activation_bytes();
      // A chunk without the embedding: the same input activation in both, and (without the
      // head) the same output gradient; bf16 values in [1, 2).
      std::vector<std::uint16_t> fill(bytes / 2);
      for (std::size_t i = 0; i < fill.size(); ++i)
        fill[i] = static_cast<std::uint16_t>(0x3f80 + (i * 7919) % 128);
      auto load = [&](gpu_chunk& s, void* dst) { s.copy_from_host(dst, fill.data(), bytes); };
      if (!host.range().embedding) {
        load(whole, whole.input(0));
        load(pieces, pieces.input(0));
      }
      const double loss = whole.forward(0, b.inputs.data(), head ? b.targets.data() : nullptr);
      double piece_loss = 0;
      std::vector<std::vector<int>> stops;
      {
        auto pass = pieces.forward_pass(0, b.inputs.data(), head ? b.targets.data() : nullptr, 1.0f,
                                        true, 0, &piece_loss);
        while (const auto* stop = pass.next()) {
          stops.push_back(*stop);
          cuda_ok(cudaSetDevice(0));  // what a stage may do between the pieces
        }
      }
      CHECK(stops == pass_stops(host.range(), pass_kind::forward));
      if (head) {
        CHECK(piece_loss == loss);
      } else {
        CHECK(std::isnan(piece_loss));
        load(whole, whole.output_gradient(0));
        load(pieces, pieces.output_gradient(0));
      }
      const void* dwhole = whole.backward_input(0, head ? nullptr : whole.output_gradient(0));
      whole.backward_weight(0);
      const void* dpieces = nullptr;
      stops.clear();
      {
        auto pass =
            pieces.backward_input_pass(0, head ? nullptr : pieces.output_gradient(0), &dpieces);
        while (const auto* stop = pass.next()) stops.push_back(*stop);
      }
      CHECK(stops == pass_stops(host.range(), pass_kind::backward));
      stops.clear();
      {
        auto pass = pieces.backward_weight_pass(0, {});
        while (const auto* stop = pass.next()) stops.push_back(*stop);
      }
      CHECK(stops == pass_stops(host.range(), pass_kind::weight, recompute));
      CHECK((dwhole == nullptr) == (dpieces == nullptr));
      if (dwhole) {
        std::vector<std::uint16_t> a(bytes / 2), p(bytes / 2);
        whole.copy_to_host(a.data(), dwhole, bytes);
        pieces.copy_to_host(p.data(), dpieces, bytes);
        CHECK(a == p);
      }
      CHECK(whole.gradients() == pieces.gradients());
    }
}

// A checkpoint's capture (begin_state_copy): the copy into pinned memory begins behind the
// chunk's work so far and overlaps the forward and backward that follow; once its call returns,
// the floats are the master weights and moments as they were at the capture, bitwise, and stay
// so while the chunk updates (so the stage's update waits for the call alone); the next capture
// takes the new state. With the memory reserved at construction or at the first capture alike.
TEST_CASE("a GPU chunk's checkpoint copy holds the state of its capture while it trains on",
          "[gpu][stage]") {
  for (const bool reserved : {true, false}) {
    INFO("pinned memory allocated " << (reserved ? "with the chunk" : "at the first capture"));
    gpt_chunk host(kConfig, chunk_range::whole(kConfig));
    host.init_gpt2(5);
    gpu_trainer_options options;
    options.pinned_state_copy = reserved;
    gpu_chunk chunk(host, kB, kT, options, 1);
    const auto P = static_cast<std::size_t>(chunk.parameter_count());
    optimizer_config oc;
    oc.warmup_steps = 1;
    auto train = [&](int step, std::uint64_t salt) {
      const auto b = make_batch(salt);
      chunk.zero_grad();
      chunk.forward(0, b.inputs.data(), b.targets.data());
      chunk.backward(0, nullptr);
      chunk.adamw(adamw_hparams_at(oc, learning_rate(oc, step, 4)), step + 1, 1.0f);
    };
    train(0, 1);
    const auto params = chunk.parameters();
    const auto [m, v] = chunk.moments();
    auto view = chunk.begin_state_copy(true);
    const auto b = make_batch(2);  // the next step's passes read what is being copied
    chunk.zero_grad();
    chunk.forward(0, b.inputs.data(), b.targets.data());
    chunk.backward(0, nullptr);
    const float* copy = view();
    auto floats = [&](std::size_t at) { return std::vector<float>(copy + at, copy + at + P); };
    CHECK(floats(0) == params);
    CHECK(floats(P) == m);
    CHECK(floats(2 * P) == v);
    chunk.adamw(adamw_hparams_at(oc, learning_rate(oc, 1, 4)), 2, 1.0f);
    const auto updated = chunk.parameters();
    REQUIRE(updated != params);
    CHECK(floats(0) == params);  // the update changed the chunk, not the copy
    CHECK(floats(2 * P) == v);
    const float* again = chunk.begin_state_copy(false)();
    CHECK(std::vector<float>(again, again + P) == updated);
  }
}
