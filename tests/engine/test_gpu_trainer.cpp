// The GPT-2 model on the GPU against the serial CPU engine (`gpu` suite; exit 77, SKIP, without
// a device): the same weights, gradients and training steps within the dtype's tolerance, fp32,
// bf16 and fp16 (with a loss scale), with either attention kernel; gradients accumulate and
// repeat bitwise; activation checkpointing changes no bit and allocates what plan_gpu_memory
// says.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "engine/chunks/gpu_chunk.hpp"
#include "engine/model/gpt_model.hpp"
#include "engine/model/random.hpp"
#include "engine/model/sample.hpp"
#include "engine/training/gpu_trainer.hpp"
#include "engine/training/optimizer.hpp"
#include "tests/engine/engine_test_util.hpp"

using namespace troupe::engine;
using troupe::engine::test::relative_difference;

namespace {

const gpt_config kConfig{97, 128, 64, 2, 4, 64};  // vocab 97 (padded 128), head size 16
constexpr int kB = 2, kT = 48;
// The attention kernels a dtype has: cuDNN's computes in 16 bits only.
std::vector<attention_kernel> attention_kernels(compute_dtype dtype) {
  if (dtype == compute_dtype::fp32)
    return {attention_kernel::fused, attention_kernel::materialized};
  return {attention_kernel::fused, attention_kernel::materialized, attention_kernel::cudnn};
}

using batch = troupe::engine::test::token_batch;

batch make_batch(std::uint64_t salt) {
  return troupe::engine::test::gpu_test_batch(salt, kB, kT, kConfig.vocab_size);
}

struct cpu_run {
  std::vector<double> losses, norms;
  std::vector<std::vector<float>> grads;  // each step's, before clipping
  std::vector<float> params;
};

cpu_run run_cpu(const optimizer_config& oc, int steps) {
  cpu_run r;
  gpt_chunk model(kConfig, chunk_range::whole(kConfig));
  model.init_gpt2(42);
  adamw_optimizer opt(model);
  gpt_activations acts(model, kB, kT);
  for (int s = 0; s < steps; ++s) {
    const auto b = make_batch(static_cast<std::uint64_t>(s) * 1000);
    model.zero_grad();
    chunk_forward(model, acts, b.inputs.data(), nullptr);
    r.losses.push_back(chunk_loss_backward_start(model, acts, b.targets.data(), 1.0f).mean());
    chunk_backward(model, acts, nullptr, nullptr);
    r.grads.emplace_back(model.grads(), model.grads() + model.parameter_count());
    r.norms.push_back(opt.step(model, oc, s, steps).grad_norm);
  }
  r.params.assign(model.params(), model.params() + model.parameter_count());
  return r;
}

// How the parameters after AdamW are compared. AdamW turns rounding into whole steps: its first
// update is lr * g / (|g| + eps), +-lr for any |g| >> eps, so an element whose gradient the two
// engines give within rounding of zero moves +-lr at random (the key third of every c_attn.bias,
// whose true gradient is exactly 0, is the systematic case: softmax ignores a shift shared by
// every key); later updates follow ratios of gradients, so one the engines give `agree` apart
// (relatively) moves up to about agree * lr more per step. Measured on the CPU alone: the CPU
// engine against itself with every nonzero gradient moved by 1e-7 of its tensor's
// largest (a rounding of a sum at that scale) ends these four steps up to 4-6e-5 of the largest
// parameter apart, at elements whose first gradient is ~1e-8 while their tensor's reach 1e-3.
// So an element whose gradient the GPU gives within `agree` of the CPU's at every step is held
// to param_tol (of the largest parameter); the others, undetermined, to the 2 * steps * lr that
// AdamW can move them at most, and there may be at most max_undetermined (a fraction) of them.
struct param_tolerance {
  double param_tol;         // max |gpu - cpu| / max |cpu| over determined elements
  double agree;             // |g_gpu - g_cpu| <= agree * |g_cpu| at every step: determined
  double max_undetermined;  // at most this fraction of the elements undetermined
};

// The elements whose gradient the GPU gives more than `agree` (relatively) from the CPU's at
// some step.
std::vector<bool> undetermined_elements(const std::vector<std::vector<float>>& gpu_grads,
                                        const cpu_run& want, double agree) {
  std::vector<bool> off(want.params.size(), false);
  for (std::size_t s = 0; s < gpu_grads.size(); ++s)
    for (std::size_t i = 0; i < off.size(); ++i) {
      const double c = want.grads[s][i];
      if (std::abs(gpu_grads[s][i] - c) > agree * std::abs(c)) off[i] = true;
    }
  return off;
}

struct param_comparison {
  std::size_t undetermined = 0;
  double worst_determined = 0, worst_undetermined = 0;  // max |gpu - cpu|
  std::size_t worst_at = 0;                             // of the determined
};

param_comparison compare_params(const std::vector<float>& got, const std::vector<float>& expected,
                                const std::vector<bool>& undetermined) {
  param_comparison c;
  for (std::size_t i = 0; i < got.size(); ++i) {
    const double diff = std::abs(double(got[i]) - double(expected[i]));
    if (undetermined[i]) {
      ++c.undetermined;
      c.worst_undetermined = std::max(c.worst_undetermined, diff);
    } else if (diff > c.worst_determined) {
      c.worst_determined = diff;
      c.worst_at = i;
    }
  }
  return c;
}

double largest_magnitude(const std::vector<float>& v) {
  double mag = 1e-30;
  for (const float x : v) mag = std::max(mag, double(std::abs(x)));
  return mag;
}

// For the failure message: how many elements each `agree` leaves undetermined, and the worst
// determined difference (of the largest parameter) it leaves.
std::string agreement_table(const std::vector<std::vector<float>>& gpu_grads, const cpu_run& want,
                            const std::vector<float>& got) {
  std::string text;
  for (const double agree : {1e-4, 1e-3, 1e-2, 1e-1, 1.0}) {
    const auto c = compare_params(got, want.params, undetermined_elements(gpu_grads, want, agree));
    text += "\n  agree " + std::to_string(agree) + ": " + std::to_string(c.undetermined) + " of " +
            std::to_string(got.size()) + " undetermined, determined max diff " +
            std::to_string(c.worst_determined / largest_magnitude(want.params));
  }
  return text;
}

// Four AdamW steps on the GPU against the CPU; backward seeded with loss_scale (a power of two),
// unscaled in the update as the training loop does.
void compare(compute_dtype dtype, double loss_tol, double grad_tol, param_tolerance pt,
             float loss_scale = 1.0f, attention_kernel attention = attention_kernel::fused,
             bool fast_kernels = false) {
  optimizer_config oc;
  oc.warmup_steps = 1;
  const int steps = 4;
  const auto want = run_cpu(oc, steps);
  gpu_trainer gpu(kConfig, kB, kT, gpu_trainer_options{dtype, false, attention, fast_kernels}, 42);
  std::vector<std::vector<float>> gpu_grads;
  for (int s = 0; s < steps; ++s) {
    const auto b = make_batch(static_cast<std::uint64_t>(s) * 1000);
    gpu.zero_grad();
    const double loss = gpu.forward_backward(b.inputs.data(), b.targets.data(), loss_scale);
    gpu_grads.push_back(gpu.gradients());
    for (auto& g : gpu_grads.back()) g /= loss_scale;
    if (s == 0) {
      INFO("first step's gradients");
      CHECK(relative_difference(gpu_grads[0], want.grads[0]) <= grad_tol);
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
  const auto got = gpu.parameters();
  REQUIRE(got.size() == want.params.size());
  const auto c = compare_params(got, want.params, undetermined_elements(gpu_grads, want, pt.agree));
  std::string worst_name;
  for (const auto& p : gpu.layout()) {
    const auto from = static_cast<std::size_t>(p.offset);
    if (c.worst_at >= from && c.worst_at < from + static_cast<std::size_t>(p.numel))
      worst_name = p.name + "[" + std::to_string(c.worst_at - from) + "]";
  }
  INFO("worst determined element " << worst_name << ": " << got[c.worst_at] << " vs "
                                   << want.params[c.worst_at]
                                   << agreement_table(gpu_grads, want, got));
  CHECK(c.worst_determined / largest_magnitude(want.params) <= pt.param_tol);
  CHECK(c.worst_undetermined <= 2.0 * steps * oc.lr);
  CHECK(double(c.undetermined) <= pt.max_undetermined * double(got.size()));
}

}  // namespace

TEST_CASE("GPT-2 on the GPU in fp32 trains as the CPU engine does", "[gpu][trainer]") {
  compare(compute_dtype::fp32, 1e-5, 1e-4, {1e-5, 1e-2, 0.02});
}

TEST_CASE("GPT-2 on the GPU in bf16 (fp32 master weights) follows the CPU engine",
          "[gpu][trainer]") {
  compare(compute_dtype::bf16, 2e-2, 5e-2, {1e-2, 1.0, 0.1});
}

TEST_CASE("GPT-2 on the GPU in fp16 with a loss scale follows the CPU engine", "[gpu][trainer]") {
  // fp16 keeps 10 mantissa bits (bf16 7): tighter than bf16; the scale keeps small activation
  // gradients out of fp16's subnormals.
  compare(compute_dtype::fp16, 1e-2, 3e-2, {5e-3, 1.0, 0.03}, 1024.0f);
}

// The materialized attention (tensor-core GEMMs around a fused softmax, scores and probabilities
// stored in the compute dtype) against the same CPU runs and the same bounds as the fused kernel.
TEST_CASE("GPT-2 on the GPU with materialized attention trains as the CPU engine does",
          "[gpu][trainer]") {
  SECTION("fp32") {
    compare(compute_dtype::fp32, 1e-5, 1e-4, {1e-5, 1e-2, 0.02}, 1.0f,
            attention_kernel::materialized);
  }
  SECTION("bf16") {
    compare(compute_dtype::bf16, 2e-2, 5e-2, {1e-2, 1.0, 0.1}, 1.0f,
            attention_kernel::materialized);
  }
  SECTION("fp16 with a loss scale") {
    compare(compute_dtype::fp16, 1e-2, 3e-2, {5e-3, 1.0, 0.03}, 1024.0f,
            attention_kernel::materialized);
  }
}

// cuDNN's flash attention (16-bit only) against the same CPU runs and bounds.
TEST_CASE("GPT-2 on the GPU with cuDNN attention trains as the CPU engine does", "[gpu][trainer]") {
  SECTION("bf16") {
    compare(compute_dtype::bf16, 2e-2, 5e-2, {1e-2, 1.0, 0.1}, 1.0f, attention_kernel::cudnn);
  }
  SECTION("fp16 with a loss scale") {
    compare(compute_dtype::fp16, 1e-2, 3e-2, {5e-3, 1.0, 0.03}, 1024.0f, attention_kernel::cudnn);
  }
  SECTION("bf16, fast kernels") {
    compare(compute_dtype::bf16, 2e-2, 5e-2, {1e-2, 1.0, 0.1}, 1.0f, attention_kernel::cudnn, true);
  }
  SECTION("fp16 with a loss scale, fast kernels") {
    compare(compute_dtype::fp16, 1e-2, 3e-2, {5e-3, 1.0, 0.03}, 1024.0f, attention_kernel::cudnn,
            true);
  }
}

// The fast kernels with either attention kernel. The test model's width (64) is narrower than
// a warp's row of 16-byte vectors (128 values in fp32, 256 in bf16), so its layernorm falls back
// to the warp-per-row kernel: this covers the one AdamW launch over the flat buffers, and the
// fallback; test_cuda_ops and cli_gpu_train (width 256) cover the 128-bit layernorm.
TEST_CASE("GPT-2 on the GPU with the fast kernels trains as the CPU engine does",
          "[gpu][trainer]") {
  SECTION("fp32, fused attention") {
    compare(compute_dtype::fp32, 1e-5, 1e-4, {1e-5, 1e-2, 0.02}, 1.0f, attention_kernel::fused,
            true);
  }
  SECTION("bf16, materialized attention") {
    compare(compute_dtype::bf16, 2e-2, 5e-2, {1e-2, 1.0, 0.1}, 1.0f, attention_kernel::materialized,
            true);
  }
}

// Width 40 (head size 20: the materialized attention) gives parameters whose sizes are no
// multiple of 16, so the flat layout has alignment gaps: the one AdamW launch covers them (they
// stay zero), and as the layernorm is too narrow for the 128-bit kernels the whole run is bitwise
// the per-tensor one.
TEST_CASE("the fast kernels' AdamW covers a layout with gaps, bitwise the per-tensor launches",
          "[gpu][trainer]") {
  const gpt_config odd{97, 128, 64, 2, 2, 40};
  gpu_trainer_options plain{compute_dtype::fp32, false, attention_kernel::materialized};
  gpu_trainer_options fast = plain;
  fast.fast_kernels = true;
  gpu_trainer a(odd, kB, kT, plain, 5), b(odd, kB, kT, fast, 5);
  optimizer_config oc;
  oc.warmup_steps = 1;
  for (int s = 0; s < 3; ++s) {
    const auto batch =
        troupe::engine::test::gpu_test_batch(static_cast<std::uint64_t>(s), kB, kT, odd.vocab_size);
    const auto ra = a.train_step(batch.inputs.data(), batch.targets.data(), oc, s, 3);
    const auto rb = b.train_step(batch.inputs.data(), batch.targets.data(), oc, s, 3);
    CHECK(ra.loss == rb.loss);
    CHECK(ra.grad_norm == rb.grad_norm);
  }
  CHECK(a.parameters() == b.parameters());
}

TEST_CASE("activation checkpointing on the GPU changes no bit and allocates the plan",
          "[gpu][trainer]") {
  for (auto dtype : {compute_dtype::fp32, compute_dtype::bf16, compute_dtype::fp16})
    for (auto attention : attention_kernels(dtype)) {
      INFO("dtype " << compute_dtype_name(dtype) << ", " << attention_kernel_name(attention)
                    << " attention");
      gpt_chunk host(kConfig, chunk_range::whole(kConfig));
      host.init_gpt2(3);
      gpu_trainer plain(host, kB, kT, {dtype, false, attention});
      gpu_trainer recomputed(host, kB, kT, {dtype, true, attention});
      const auto plan_plain = plan_gpu_memory(kConfig, kB, kT, {dtype, false, attention});
      const auto plan_recompute = plan_gpu_memory(kConfig, kB, kT, {dtype, true, attention});
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

// A split backward (zero-bubble schedules) on a GPU chunk: B for two micro-batches in flight,
// then their W, gives bitwise the whole backward's gradients, makes the same blocks final in the
// same order, and allocates what plan_gpu_chunk_memory says. Chunks of the whole model and of a
// pipeline's last rank (whose input's gradient B writes apart from its input); and with
// activation checkpointing, where B and W each recompute the blocks' internals.
TEST_CASE("a split backward on the GPU is the whole backward, bitwise", "[gpu][trainer]") {
  for (auto dtype : {compute_dtype::fp32, compute_dtype::bf16})
    for (auto attention : attention_kernels(dtype))
      for (const auto& range : {chunk_range::whole(kConfig), partition_layers(kConfig, 2)[1]})
        for (bool recompute : {false, true}) {
          INFO(compute_dtype_name(dtype)
               << ", " << attention_kernel_name(attention) << " attention, embedding "
               << range.embedding << ", recompute " << recompute);
          gpt_chunk host(kConfig, range);
          host.init_gpt2(3);
          gpu_trainer_options whole_options{dtype, false, attention};
          gpu_trainer_options split_options = whole_options;
          split_options.split_backward = true;
          split_options.recompute = recompute;
          gpu_chunk whole(host, kB, kT, whole_options, 2);
          gpu_chunk split(host, kB, kT, split_options, 2);
          CHECK(split.device_bytes() ==
                plan_gpu_chunk_memory(kConfig, range, kB, kT, split_options, 2).total());
          // An input activation in the chunk's dtype: small fp32 values, or bf16 bit patterns of
          // values in [2^-7, 2^-6).
          std::vector<unsigned char> input(whole.activation_bytes());
          for (std::size_t i = 0; i + 4 <= input.size(); i += 4) {
            const float f =
                static_cast<float>(static_cast<int>(splitmix64(i) % 2001) - 1000) * 1e-3f;
            const std::uint16_t h = static_cast<std::uint16_t>(0x3C00 | (splitmix64(i) % 128));
            if (dtype == compute_dtype::fp32) {
              std::memcpy(&input[i], &f, 4);
            } else {
              std::memcpy(&input[i], &h, 2);
              std::memcpy(&input[i + 2], &h, 2);
            }
          }
          std::vector<int> whole_blocks, split_blocks;
          for (int slot = 0; slot < 2; ++slot) {
            const auto b = make_batch(static_cast<std::uint64_t>(slot) + 11);
            for (auto* g : {&whole, &split}) {
              if (!range.embedding)
                g->copy_from_host(g->input(slot), input.data(), g->activation_bytes());
              g->forward(slot, b.inputs.data(), b.targets.data(), 4.0f);
            }
          }
          for (int slot : {1, 0})
            whole.backward(slot, nullptr, [&](int block) { whole_blocks.push_back(block); });
          for (int slot : {1, 0}) split.backward_input(slot, nullptr);
          for (int slot : {1, 0})
            split.backward_weight(slot, [&](int block) { split_blocks.push_back(block); });
          CHECK(split_blocks == whole_blocks);
          CHECK(split.gradients() == whole.gradients());
        }
}

TEST_CASE("the GPU trainer starts from given host weights, evaluates and hands weights back",
          "[gpu][trainer]") {
  gpt_chunk host(kConfig, chunk_range::whole(kConfig));
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
  gpt_chunk back(kConfig, chunk_range::whole(kConfig));
  from_host.copy_parameters_to(back);
  CHECK(std::vector<float>(back.params(), back.params() + back.parameter_count()) ==
        from_host.parameters());
  CHECK(from_host.parameters() != from_seed.parameters());
}

TEST_CASE("GPU gradients accumulate across batches and repeat bitwise", "[gpu][trainer]") {
  for (auto dtype : {compute_dtype::fp32, compute_dtype::bf16, compute_dtype::fp16})
    for (auto attention : attention_kernels(dtype)) {
      INFO("dtype " << compute_dtype_name(dtype) << ", " << attention_kernel_name(attention)
                    << " attention");
      gpu_trainer gpu(kConfig, kB, kT, gpu_trainer_options{dtype, false, attention}, 7);
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

TEST_CASE("a GPU chunk times its ops by family while asked to, changing no bit", "[gpu][trainer]") {
  for (auto attention : attention_kernels(compute_dtype::bf16)) {
    INFO(attention_kernel_name(attention) << " attention");
    gpu_trainer timed(kConfig, kB, kT, gpu_trainer_options{compute_dtype::bf16, false, attention},
                      7);
    gpu_trainer plain(kConfig, kB, kT, gpu_trainer_options{compute_dtype::bf16, false, attention},
                      7);
    const auto b = make_batch(5);
    timed.forward_backward(b.inputs.data(), b.targets.data());
    CHECK(timed.chunk().take_kernel_times().empty());  // timing is off by default
    timed.chunk().set_kernel_timing(true);
    timed.zero_grad();
    plain.zero_grad();
    timed.forward_backward(b.inputs.data(), b.targets.data());
    plain.forward_backward(b.inputs.data(), b.targets.data());
    const auto times = timed.chunk().take_kernel_times();
    auto calls = [&](const std::string& family) {
      for (const auto& t : times) {
        CHECK(t.ms >= 0);
        if (t.family == family) return t.calls;
      }
      return 0;
    };
    CHECK(calls("attention forward") == kConfig.layers);
    CHECK(calls("attention backward") == kConfig.layers);
    CHECK(calls("layernorm forward") == 2 * kConfig.layers + 1);
    CHECK(calls("softmax + cross-entropy") == 1);
    double total = 0;
    for (const auto& t : times) total += t.ms;
    CHECK(total > 0);
    CHECK(timed.chunk().take_kernel_times().empty());  // nothing ran since
    CHECK(timed.gradients() == plain.gradients());
    timed.chunk().set_kernel_timing(false);
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

// Sampling on the GPU (`troupe sample --device cuda`): the logits at a window's last position
// are the CPU's (engine::next_token_logits) within fp32 rounding, for windows of every length
// up to the context, each a different sequence length for the same trainer.
TEST_CASE("the GPU's next-token logits are the CPU's", "[gpu][trainer]") {
  gpt_chunk host(kConfig, chunk_range::whole(kConfig));
  host.init_gpt2(11);
  gpu_trainer gpu(host, 1, kConfig.context, gpu_trainer_options{});
  next_token_logits cpu(host);
  std::vector<std::int32_t> tokens;
  for (int i = 0; i < kConfig.context; ++i) tokens.push_back((i * 37 + 5) % kConfig.vocab_size);
  for (int T : {1, 2, 17, kConfig.context}) {
    INFO("window of " << T);
    const auto want =
        cpu(std::span<const std::int32_t>(tokens.data(), static_cast<std::size_t>(T)));
    const auto got = gpu.last_logits(tokens.data(), T);
    REQUIRE(got.size() == want.size());
    const std::vector<float> want_v(want.begin(), want.end());
    CHECK(relative_difference(got, want_v) <= 1e-5);
  }
  CHECK_THROWS(gpu_trainer(kConfig, 2, kT, gpu_trainer_options{}, 3)
                   .last_logits(tokens.data(), kT));  // B = 2: not a sampler
}
