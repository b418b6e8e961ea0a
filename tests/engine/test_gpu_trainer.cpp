// The GPT-2 model on the GPU against the serial CPU engine (`gpu` suite; exit 77, SKIP, without
// a device): the same weights, gradients and training steps within the dtype's tolerance, fp32,
// bf16 and fp16 (with a loss scale); gradients accumulate and repeat bitwise; activation
// checkpointing changes no bit and allocates what plan_gpu_memory says.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "engine/gpt_model.hpp"
#include "engine/gpu_trainer.hpp"
#include "engine/optimizer.hpp"
#include "engine/random.hpp"
#include "tests/engine/engine_test_util.hpp"

using namespace troupe::engine;
using troupe::engine::test::relative_difference;

namespace {

const gpt_config kConfig{97, 128, 64, 2, 4, 64};  // vocab 97 (padded 128), head size 16
constexpr int kB = 2, kT = 48;

using batch = troupe::engine::test::token_batch;

batch make_batch(std::uint64_t salt) {
  return troupe::engine::test::gpu_test_batch(salt, kB, kT, kConfig.vocab_size);
}

struct cpu_run {
  std::vector<double> losses, norms;
  std::vector<float> first_grads, params;
};

cpu_run run_cpu(const optimizer_config& oc, int steps) {
  cpu_run r;
  gpt_stage model(kConfig, stage_range::whole(kConfig));
  model.init_gpt2(42);
  adamw_optimizer opt(model);
  gpt_activations acts(model, kB, kT);
  for (int s = 0; s < steps; ++s) {
    const auto b = make_batch(static_cast<std::uint64_t>(s) * 1000);
    model.zero_grad();
    stage_forward(model, acts, b.inputs.data(), nullptr);
    r.losses.push_back(stage_loss_backward_start(model, acts, b.targets.data(), 1.0f).mean());
    stage_backward(model, acts, nullptr, nullptr);
    if (s == 0) r.first_grads.assign(model.grads(), model.grads() + model.parameter_count());
    r.norms.push_back(opt.step(model, oc, s, steps).grad_norm);
  }
  r.params.assign(model.params(), model.params() + model.parameter_count());
  return r;
}

// Four AdamW steps on the GPU against the CPU; backward seeded with loss_scale (a power of two),
// unscaled in the update as the training loop does.
void compare(compute_dtype dtype, double loss_tol, double grad_tol, double param_tol,
             float loss_scale = 1.0f) {
  optimizer_config oc;
  oc.warmup_steps = 1;
  const int steps = 4;
  const auto want = run_cpu(oc, steps);
  gpu_trainer gpu(kConfig, kB, kT, dtype, 42);
  for (int s = 0; s < steps; ++s) {
    const auto b = make_batch(static_cast<std::uint64_t>(s) * 1000);
    gpu.zero_grad();
    const double loss = gpu.forward_backward(b.inputs.data(), b.targets.data(), loss_scale);
    if (s == 0) {
      INFO("first step's gradients");
      auto unscaled = gpu.gradients();
      for (auto& g : unscaled) g /= loss_scale;
      CHECK(relative_difference(unscaled, want.first_grads) <= grad_tol);
    }
    const double norm = std::sqrt(gpu.grad_square_sum()) / loss_scale;
    REQUIRE(std::isfinite(norm));
    gpu.update(oc, s, steps, clip_coefficient(norm, oc.grad_clip) / loss_scale);
    INFO("step " << s << ": loss " << loss << " vs " << want.losses[static_cast<std::size_t>(s)]
                 << ", norm " << norm << " vs " << want.norms[static_cast<std::size_t>(s)]);
    CHECK(std::abs(loss - want.losses[static_cast<std::size_t>(s)]) <=
          loss_tol * want.losses[static_cast<std::size_t>(s)]);
    CHECK(std::abs(norm - want.norms[static_cast<std::size_t>(s)]) <=
          10 * loss_tol * want.norms[static_cast<std::size_t>(s)]);
  }
  // The key third of every c_attn.bias has a true gradient of exactly 0 (softmax ignores a
  // shift shared by every key), so both engines hold rounding noise there, which AdamW turns
  // into steps of up to lr each way (g / (|g| + eps)). Those entries are checked against that
  // bound; every other parameter against param_tol.
  auto got = gpu.parameters(), expected = want.params;
  std::vector<float> got_k, expected_k;
  for (const auto& p : gpu.layout()) {
    if (p.name.find("attn.c_attn.bias") == std::string::npos) continue;
    const auto from = static_cast<std::size_t>(p.offset + kConfig.width);
    for (std::size_t i = from; i < from + static_cast<std::size_t>(kConfig.width); ++i) {
      got_k.push_back(std::exchange(got[i], 0.0f));
      expected_k.push_back(std::exchange(expected[i], 0.0f));
    }
  }
  REQUIRE(got_k.size() == static_cast<std::size_t>(kConfig.layers * kConfig.width));
  CHECK(relative_difference(got, expected) <= param_tol);
  for (std::size_t i = 0; i < got_k.size(); ++i)
    CHECK(std::abs(got_k[i] - expected_k[i]) <= 2.0 * steps * oc.lr);
}

}  // namespace

TEST_CASE("GPT-2 on the GPU in fp32 trains as the CPU engine does", "[gpu][trainer]") {
  compare(compute_dtype::fp32, 1e-5, 1e-4, 1e-5);
}

TEST_CASE("GPT-2 on the GPU in bf16 (fp32 master weights) follows the CPU engine",
          "[gpu][trainer]") {
  compare(compute_dtype::bf16, 2e-2, 5e-2, 1e-2);
}

TEST_CASE("GPT-2 on the GPU in fp16 with a loss scale follows the CPU engine", "[gpu][trainer]") {
  // fp16 keeps 10 mantissa bits (bf16 7): tighter than bf16; the scale keeps small activation
  // gradients out of fp16's subnormals.
  compare(compute_dtype::fp16, 1e-2, 3e-2, 5e-3, 1024.0f);
}

TEST_CASE("activation checkpointing on the GPU changes no bit and allocates the plan",
          "[gpu][trainer]") {
  for (auto dtype : {compute_dtype::fp32, compute_dtype::bf16, compute_dtype::fp16}) {
    INFO("dtype " << compute_dtype_name(dtype));
    gpt_stage host(kConfig, stage_range::whole(kConfig));
    host.init_gpt2(3);
    gpu_trainer plain(host, kB, kT, {dtype, false});
    gpu_trainer recomputed(host, kB, kT, {dtype, true});
    const auto plan_plain = plan_gpu_memory(kConfig, kB, kT, {dtype, false});
    const auto plan_recompute = plan_gpu_memory(kConfig, kB, kT, {dtype, true});
    CHECK(plain.device_bytes() == plan_plain.total());
    CHECK(recomputed.device_bytes() == plan_recompute.total());
    CHECK(recomputed.device_bytes() < plain.device_bytes());
    optimizer_config oc;
    oc.warmup_steps = 1;
    for (int s = 0; s < 3; ++s) {
      const auto b = make_batch(static_cast<std::uint64_t>(s) * 31 + 2);
      for (auto* g : {&plain, &recomputed}) {
        g->zero_grad();
        g->forward_backward(b.inputs.data(), b.targets.data(), 8.0f);
      }
      CHECK(recomputed.gradients() == plain.gradients());
      for (auto* g : {&plain, &recomputed}) g->update(oc, s, 3, 1.0 / 8);
    }
    CHECK(recomputed.parameters() == plain.parameters());
  }
}

TEST_CASE("the GPU trainer starts from given host weights, evaluates and hands weights back",
          "[gpu][trainer]") {
  gpt_stage host(kConfig, stage_range::whole(kConfig));
  host.init_gpt2(42);
  gpu_trainer from_host(host, kB, kT, {compute_dtype::fp32, false});
  gpu_trainer from_seed(kConfig, kB, kT, compute_dtype::fp32, 42);
  CHECK(from_host.parameters() == from_seed.parameters());
  const auto b = make_batch(9);
  from_host.zero_grad();
  const double eval = from_host.evaluate(b.inputs.data(), b.targets.data());
  CHECK(from_host.gradients() == std::vector<float>(from_host.gradients().size(), 0.0f));
  CHECK(eval == from_host.forward_backward(b.inputs.data(), b.targets.data()));
  from_host.update(optimizer_config{}, 0, 1, 1.0);
  gpt_stage back(kConfig, stage_range::whole(kConfig));
  from_host.copy_parameters_to(back);
  CHECK(std::vector<float>(back.params(), back.params() + back.parameter_count()) ==
        from_host.parameters());
  CHECK(from_host.parameters() != from_seed.parameters());
}

TEST_CASE("GPU gradients accumulate across batches and repeat bitwise", "[gpu][trainer]") {
  for (auto dtype : {compute_dtype::fp32, compute_dtype::bf16, compute_dtype::fp16}) {
    gpu_trainer gpu(kConfig, kB, kT, dtype, 7);
    const auto b = make_batch(5);
    gpu.zero_grad();
    const double l1 = gpu.forward_backward(b.inputs.data(), b.targets.data());
    const auto once = gpu.gradients();
    // Deterministic: the same batch again from zero gives bitwise the same loss and gradients.
    gpu.zero_grad();
    const double l2 = gpu.forward_backward(b.inputs.data(), b.targets.data());
    CHECK(l1 == l2);
    CHECK(gpu.gradients() == once);
    // Accumulating: a second batch without zero_grad adds (wte sums head and embedding parts,
    // so the sum is within rounding, not bitwise, of twice).
    gpu.forward_backward(b.inputs.data(), b.targets.data());
    auto twice = once;
    for (auto& g : twice) g *= 2;
    CHECK(relative_difference(gpu.gradients(), twice) <= 1e-6);
    // A loss scale of 2^10 scales every gradient by 2^10 (exactly, in exact arithmetic; the
    // kernels' rounding is scale-invariant for powers of two).
    if (dtype == compute_dtype::fp32) {
      gpu.zero_grad();
      gpu.forward_backward(b.inputs.data(), b.targets.data(), 1024.0f);
      auto scaled = once;
      for (auto& g : scaled) g *= 1024.0f;
      CHECK(relative_difference(gpu.gradients(), scaled) <= 1e-6);
    }
  }
}

TEST_CASE("the GPU trainer refuses a token outside the vocabulary", "[gpu][trainer]") {
  gpu_trainer gpu(kConfig, kB, kT, compute_dtype::fp32, 1);
  auto b = make_batch(1);
  b.inputs[3] = 97;
  CHECK_THROWS_WITH(gpu.forward_backward(b.inputs.data(), b.targets.data()),
                    Catch::Contains("token 97 outside the vocabulary of 97"));
  // A target too (the kernel would read outside the logits row): ignore_index alone is exempt.
  b = make_batch(1);
  b.targets[5] = 100;
  CHECK_THROWS_WITH(gpu.forward_backward(b.inputs.data(), b.targets.data()),
                    Catch::Contains("target 100 outside the vocabulary of 97"));
}
