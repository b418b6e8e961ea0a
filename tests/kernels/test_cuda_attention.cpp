// Causal attention (the fused kernel and the materialized route) and the embedding on the GPU
// against the CPU reference, in fp32, bf16 and fp16 (tolerance scaled by the dtype, inputs
// rounded to it first), and the ops' timing. `gpu` suite: exit 77 (SKIP) without a device.
#include <catch2/catch.hpp>

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

#include "kernels/cpu_ops.hpp"
#include "kernels/cuda/cuda_ops.hpp"
#include "tests/kernels/cuda_test_util.hpp"

using namespace cuda_test;

namespace {

template <class T>
void check_attention(int B, int Tn, int NH, int hs, std::uint32_t seed) {
  const int C = NH * hs;
  const auto n = static_cast<std::size_t>(B) * Tn;
  const auto qkv = rounded<T>(random_values(n * 3 * C, seed, -2, 2));
  const auto dout = rounded<T>(random_values(n * C, seed + 1));
  std::vector<float> out(n * C), att(static_cast<std::size_t>(B) * NH * Tn * Tn),
      dqkv(n * 3 * C, 0.25f);
  cpu::attention_forward(out.data(), att.data(), qkv.data(), B, Tn, C, NH);
  cpu::attention_backward(dqkv.data(), dout.data(), qkv.data(), att.data(), B, Tn, C, NH);

  cu::context ctx;
  device_array<T> gqkv(qkv), gout(n * C), gdout(dout), gdqkv(std::vector<float>(n * 3 * C, 0.25f));
  device_array<float> glse(static_cast<std::size_t>(B) * NH * Tn),
      scratch(static_cast<std::size_t>(cu::attention_scratch_floats(B, Tn, NH)));
  cu::attention_forward(ctx, gout.get(), glse.get(), gqkv.get(), B, Tn, C, NH);
  cu::attention_backward(ctx, gdqkv.get(), gdout.get(), gqkv.get(), gout.get(), glse.get(),
                         scratch.get(), B, Tn, C, NH);
  ctx.synchronize();
  INFO("B=" << B << " T=" << Tn << " heads=" << NH << " head size=" << hs);
  check_close<T>(gout.host(), out, "out", 1e-5);
  check_close<T>(gdqkv.host(), dqkv, "dqkv (accumulated onto 0.25)", 1e-4);

  // lse is log(sum_j exp(scaled score)) of each row: check row 0 (one key) and the last row.
  const auto lse = glse.host();
  const float scale = 1.0f / std::sqrt(static_cast<float>(hs));
  for (int i : {0, Tn - 1}) {
    double m = -1e30, sum = 0;
    std::vector<double> s(static_cast<std::size_t>(i) + 1);
    for (int j = 0; j <= i; ++j) {
      double dot = 0;
      for (int d = 0; d < hs; ++d)
        dot += double(qkv[static_cast<std::size_t>(i) * 3 * C + d]) *
               qkv[static_cast<std::size_t>(j) * 3 * C + C + d];
      s[static_cast<std::size_t>(j)] = dot * scale;
      m = std::max(m, s[static_cast<std::size_t>(j)]);
    }
    for (double v : s) sum += std::exp(v - m);
    CHECK(std::abs(lse[static_cast<std::size_t>(i)] - (m + std::log(sum))) <=
          1e-3 * (1 + std::abs(m)));
  }

  // Deterministic: the same inputs give bitwise the same gradient.
  device_array<T> again(std::vector<float>(n * 3 * C, 0.25f));
  cu::attention_backward(ctx, again.get(), gdout.get(), gqkv.get(), gout.get(), glse.get(),
                         scratch.get(), B, Tn, C, NH);
  ctx.synchronize();
  CHECK(again.host() == gdqkv.host());
}

}  // namespace

TEMPLATE_TEST_CASE("fused causal attention on the GPU matches the CPU reference", "[gpu]", float,
                   bf16, fp16) {
  check_attention<TestType>(2, 100, 3, 16, 21);  // T not a multiple of the 64-row tile
  check_attention<TestType>(1, 1, 2, 32, 22);    // one token
  check_attention<TestType>(2, 130, 2, 64, 23);  // GPT-2's head size, three query tiles
  check_attention<TestType>(1, 70, 2, 128, 24);  // the 32-row key tiles of head size 128
}

namespace {

// The materialized route (tensor-core GEMMs around the fused causal softmax) against the CPU
// reference: out, the probabilities themselves (0 above the diagonal), dqkv. Every output and
// the scratch start poisoned with NaN: what a kernel fails to write, or a GEMM reads before it
// is written, shows.
template <class T>
void check_materialized(int B, int Tn, int NH, int hs, std::uint32_t seed) {
  const int C = NH * hs;
  const auto n = static_cast<std::size_t>(B) * Tn;
  const auto pairs = static_cast<std::size_t>(cu::attention_probs_values(B, Tn, NH));
  const auto qkv = rounded<T>(random_values(n * 3 * C, seed, -2, 2));
  const auto dout = rounded<T>(random_values(n * C, seed + 1));
  std::vector<float> out(n * C), att(pairs), dqkv(n * 3 * C, 0.25f);
  cpu::attention_forward(out.data(), att.data(), qkv.data(), B, Tn, C, NH);
  cpu::attention_backward(dqkv.data(), dout.data(), qkv.data(), att.data(), B, Tn, C, NH);

  const float nan = std::numeric_limits<float>::quiet_NaN();
  cu::context ctx;
  device_array<T> gqkv(qkv), gdout(dout), gdqkv(std::vector<float>(n * 3 * C, 0.25f));
  device_array<T> gout(std::vector<float>(n * C, nan)), gprobs(std::vector<float>(pairs, nan));
  device_array<T> scratch(std::vector<float>(
      static_cast<std::size_t>(cu::attention_materialized_scratch_values(B, Tn, C, NH)), nan));
  cu::attention_materialized_forward(ctx, gout.get(), gprobs.get(), scratch.get(), gqkv.get(), B,
                                     Tn, C, NH);
  cu::attention_materialized_backward(ctx, gdqkv.get(), gdout.get(), gqkv.get(), gprobs.get(),
                                      scratch.get(), B, Tn, C, NH);
  ctx.synchronize();
  INFO("B=" << B << " T=" << Tn << " heads=" << NH << " head size=" << hs);
  check_close<T>(gprobs.host(), att, "probabilities", 1e-5);
  check_close<T>(gout.host(), out, "out", 1e-5);
  check_close<T>(gdqkv.host(), dqkv, "dqkv (accumulated onto 0.25)", 1e-4);
  const auto probs = gprobs.host();
  std::size_t above = 0;  // values above the diagonal that are not exactly 0
  for (std::size_t p = 0; p < pairs; ++p) {
    const auto i = (p / static_cast<std::size_t>(Tn)) % static_cast<std::size_t>(Tn);
    const auto j = p % static_cast<std::size_t>(Tn);
    if (j > i && probs[p] != 0.0f) ++above;
  }
  CHECK(above == 0);

  // Deterministic: the same inputs give bitwise the same gradient, from a freshly poisoned
  // scratch (nothing of the first call's scratch is read).
  device_array<T> again(std::vector<float>(n * 3 * C, 0.25f));
  device_array<T> fresh(std::vector<float>(
      static_cast<std::size_t>(cu::attention_materialized_scratch_values(B, Tn, C, NH)), nan));
  cu::attention_materialized_backward(ctx, again.get(), gdout.get(), gqkv.get(), gprobs.get(),
                                      fresh.get(), B, Tn, C, NH);
  ctx.synchronize();
  CHECK(again.host() == gdqkv.host());
}

}  // namespace

TEMPLATE_TEST_CASE("materialized causal attention on the GPU matches the CPU reference", "[gpu]",
                   float, bf16, fp16) {
  check_materialized<TestType>(2, 100, 3, 16, 51);  // T not a multiple of a warp
  check_materialized<TestType>(1, 1, 2, 32, 52);    // one token
  check_materialized<TestType>(2, 130, 2, 64, 53);  // GPT-2's head size
  check_materialized<TestType>(1, 70, 2, 128, 54);
  check_materialized<TestType>(2, 33, 3, 48, 55);  // a head size the fused kernel has not
}

namespace {

// cuDNN's fused flash attention against the CPU reference: out and dqkv, whose every value starts
// poisoned with NaN (backward writes dqkv whole); lse as the fused kernel's (rows 0 and T-1); a
// second backward bitwise the first (cuDNN's deterministic backward).
template <class T>
void check_cudnn(int B, int Tn, int NH, int hs, std::uint32_t seed) {
  std::string why;
  const bool available = cu::cudnn_attention_available(&why);  // the GPU machines have cuDNN 9
  INFO(why);
  REQUIRE(available);
  const int C = NH * hs;
  const auto n = static_cast<std::size_t>(B) * Tn;
  const auto qkv = rounded<T>(random_values(n * 3 * C, seed, -2, 2));
  const auto dout = rounded<T>(random_values(n * C, seed + 1));
  std::vector<float> out(n * C), att(static_cast<std::size_t>(B) * NH * Tn * Tn),
      dqkv(n * 3 * C, 0.0f);
  cpu::attention_forward(out.data(), att.data(), qkv.data(), B, Tn, C, NH);
  cpu::attention_backward(dqkv.data(), dout.data(), qkv.data(), att.data(), B, Tn, C, NH);

  const float nan = std::numeric_limits<float>::quiet_NaN();
  cu::context ctx;
  device_array<T> gqkv(qkv), gdout(dout), gout(std::vector<float>(n * C, nan)),
      gdqkv(std::vector<float>(n * 3 * C, nan));
  const auto rows = static_cast<std::size_t>(B) * NH * Tn;
  device_array<float> glse(std::vector<float>(rows, nan)), fused_lse(rows),
      scratch(static_cast<std::size_t>(cu::attention_scratch_floats(B, Tn, NH)));
  device_array<T> fused_out(n * C);
  cu::attention_cudnn_forward(ctx, gout.get(), glse.get(), gqkv.get(), B, Tn, C, NH);
  cu::attention_cudnn_backward(ctx, gdqkv.get(), gdout.get(), gqkv.get(), gout.get(), glse.get(), B,
                               Tn, C, NH);
  cu::attention_forward(ctx, fused_out.get(), fused_lse.get(), gqkv.get(), B, Tn, C, NH);
  ctx.synchronize();
  INFO("B=" << B << " T=" << Tn << " heads=" << NH << " head size=" << hs);
  check_close<T>(gout.host(), out, "out", 1e-5);
  check_close<T>(gdqkv.host(), dqkv, "dqkv (written over NaN)", 1e-4);
  check_close<float>(glse.host(), fused_lse.host(), "lse (against the fused kernel's)", 1e-3);

  device_array<T> again(std::vector<float>(n * 3 * C, nan));
  cu::attention_cudnn_backward(ctx, again.get(), gdout.get(), gqkv.get(), gout.get(), glse.get(), B,
                               Tn, C, NH);
  ctx.synchronize();
  CHECK(again.host() == gdqkv.host());
  CHECK(cu::attention_cudnn_workspace_bytes(ctx) < (std::size_t{1} << 32));
}

}  // namespace

TEMPLATE_TEST_CASE("cuDNN causal attention on the GPU matches the CPU reference", "[gpu]", bf16,
                   fp16) {
  check_cudnn<TestType>(2, 128, 3, 64, 71);  // GPT-2's head size, T a multiple of 128
  check_cudnn<TestType>(2, 100, 3, 16, 72);  // T no multiple of 128 (cuDNN's padding mask)
  check_cudnn<TestType>(1, 1, 2, 32, 73);    // one token (no cuDNN graph: out = v)
  check_cudnn<TestType>(1, 200, 2, 128, 74);
  check_cudnn<TestType>(3, 64, 4, 32, 75);  // the same context: several plans
}

TEST_CASE("cuDNN attention refuses fp32 and head sizes it has no engine for", "[gpu]") {
  cu::context ctx;
  CHECK_THROWS_AS(cu::attention_cudnn_forward<float>(ctx, nullptr, nullptr, nullptr, 1, 4, 64, 1),
                  cu::cuda_error);
  CHECK_THROWS_AS(
      cu::attention_cudnn_forward<cu::bf16>(ctx, nullptr, nullptr, nullptr, 1, 4, 60, 3),
      std::invalid_argument);  // head size 20
  CHECK_THROWS_AS(
      cu::attention_cudnn_forward<cu::bf16>(ctx, nullptr, nullptr, nullptr, 1, 4, 256 * 2, 2),
      std::invalid_argument);  // head size 256
}

TEST_CASE("materialized attention refuses a width that is no multiple of the heads", "[gpu]") {
  cu::context ctx;
  CHECK_THROWS_AS(cu::attention_materialized_forward<float>(ctx, nullptr, nullptr, nullptr, nullptr,
                                                            1, 4, 50, 3),
                  std::invalid_argument);
}

TEST_CASE("a context times its ops by family while asked to", "[gpu]") {
  const int N = 64, C = 32, OC = 48;
  const auto x = random_values(static_cast<std::size_t>(N) * C, 61);
  const auto w = random_values(static_cast<std::size_t>(OC) * C, 62);
  const auto ones = std::vector<float>(C, 1.0f), zeros = std::vector<float>(C, 0.0f);
  cu::context ctx;
  device_array<float> gx(x), gw(w), gy(static_cast<std::size_t>(N) * OC), gn(x.size()), gone(ones),
      gzero(zeros), mean(N), rstd(N);
  CHECK(ctx.take_timings().empty());  // off by default
  ctx.set_timing(true);
  for (int i = 0; i < 3; ++i)
    cu::linear_forward<float>(ctx, gy.get(), gx.get(), gw.get(), nullptr, N, C, OC);
  cu::layernorm_forward<float>(ctx, gn.get(), mean.get(), rstd.get(), gx.get(), gone.get(),
                               gzero.get(), N, C);
  const auto times = ctx.take_timings();
  REQUIRE(times.size() == 2);
  CHECK(times[0].family == cu::op_family::linear_forward);
  CHECK(times[0].calls == 3);
  CHECK(times[1].family == cu::op_family::layernorm_forward);
  CHECK(times[1].calls == 1);
  for (const auto& t : times) CHECK(t.ms >= 0);
  CHECK(ctx.take_timings().empty());  // a new period
  ctx.set_timing(false);
  cu::linear_forward<float>(ctx, gy.get(), gx.get(), gw.get(), nullptr, N, C, OC);
  CHECK(ctx.take_timings().empty());
  CHECK(std::string(cu::op_family_name(cu::op_family::attention_backward)) == "attention backward");
}

TEST_CASE("attention on the GPU refuses a head size it has no kernel for", "[gpu]") {
  cu::context ctx;
  CHECK_THROWS_AS(cu::attention_forward<float>(ctx, nullptr, nullptr, nullptr, 1, 4, 48, 1),
                  std::invalid_argument);
}

TEMPLATE_TEST_CASE("embedding on the GPU matches the CPU reference", "[gpu]", float, bf16, fp16) {
  const int B = 3, Tn = 17, C = 64, V = 50;
  const auto n = static_cast<std::size_t>(B) * Tn;
  const auto wte = rounded<TestType>(random_values(static_cast<std::size_t>(V) * C, 31));
  const auto wpe = rounded<TestType>(random_values(static_cast<std::size_t>(Tn) * C, 32));
  const auto dout = rounded<TestType>(random_values(n * C, 33));
  std::vector<std::int32_t> tokens(n);
  for (std::size_t i = 0; i < n; ++i)
    tokens[i] = static_cast<std::int32_t>((i * 7) % 11 + (i % 3) * 13);
  std::vector<float> out(n * C), dwte(wte.size(), 0.5f), dwpe(wpe.size(), -0.5f);
  cpu::embedding_forward(out.data(), tokens.data(), wte.data(), wpe.data(), B, Tn, C);
  cpu::embedding_backward(dwte.data(), dwpe.data(), dout.data(), tokens.data(), B, Tn, C);

  cu::context ctx;
  std::int32_t* gtok = nullptr;
  REQUIRE(cudaMalloc(reinterpret_cast<void**>(&gtok), n * sizeof(std::int32_t)) == cudaSuccess);
  REQUIRE(cudaMemcpy(gtok, tokens.data(), n * sizeof(std::int32_t), cudaMemcpyHostToDevice) ==
          cudaSuccess);
  device_array<TestType> gwte(wte), gwpe(wpe), gout(n * C), gdout(dout);
  device_array<float> gdwte(std::vector<float>(wte.size(), 0.5f)),
      gdwpe(std::vector<float>(wpe.size(), -0.5f));
  cu::token_groups groups;
  groups.build(ctx, tokens.data(), static_cast<int>(n));
  cu::embedding_forward(ctx, gout.get(), gtok, gwte.get(), gwpe.get(), B, Tn, C);
  cu::embedding_backward(ctx, gdwte.get(), gdwpe.get(), gdout.get(), groups, B, Tn, C);
  ctx.synchronize();
  cudaFree(gtok);
  check_close<TestType>(gout.host(), out, "out");
  check_close<float>(gdwte.host(), dwte, "dwte (accumulated onto 0.5)", 1e-5);
  check_close<float>(gdwpe.host(), dwpe, "dwpe (accumulated onto -0.5)", 1e-5);
  CHECK_THROWS_AS(
      cu::embedding_backward(ctx, gdwte.get(), gdwpe.get(), gdout.get(), groups, B, Tn - 1, C),
      std::invalid_argument);
}

TEMPLATE_TEST_CASE("convert rounds fp32 master weights to the working dtype", "[gpu]", float, bf16,
                   fp16) {
  const auto x = random_values(1001, 41, -3, 3);
  cu::context ctx;
  device_array<float> gx(x);
  device_array<TestType> gy(x.size());
  cu::convert(ctx, gy.get(), gx.get(), static_cast<std::int64_t>(x.size()));
  ctx.synchronize();
  CHECK(gy.host() == rounded<TestType>(x));
}

// Dynamic loss scaling learns of an overflow from non-finite gradients: an fp16 backward whose
// true gradient exceeds fp16's range must give inf or NaN, never values clamped to 65504. dout
// (finite in fp16 either way) scaled by 2^14 gives gradients in range (about 2.5 x 2^14 at most),
// by 2^15 gradients beyond it.
TEST_CASE("an fp16 attention backward beyond fp16's range is non-finite, not saturated", "[gpu]") {
  const int B = 2, Tn = 128, NH = 4, hs = 64, C = NH * hs;
  const auto n = static_cast<std::size_t>(B) * Tn;
  const auto qkv = rounded<fp16>(random_values(n * 3 * C, 81, -2, 2));
  const auto dout1 = random_values(n * C, 82);
  for (const float scale : {16384.0f, 32768.0f}) {
    std::vector<float> dout(dout1.size());
    for (std::size_t i = 0; i < dout.size(); ++i) dout[i] = dout1[i] * scale;
    dout = rounded<fp16>(dout);
    REQUIRE(std::all_of(dout.begin(), dout.end(), [](float v) { return std::isfinite(v); }));
    std::vector<float> out(n * C), att(static_cast<std::size_t>(B) * NH * Tn * Tn),
        dqkv(n * 3 * C, 0.0f);
    cpu::attention_forward(out.data(), att.data(), qkv.data(), B, Tn, C, NH);
    cpu::attention_backward(dqkv.data(), dout.data(), qkv.data(), att.data(), B, Tn, C, NH);
    const bool in_range =
        std::all_of(dqkv.begin(), dqkv.end(), [](float v) { return std::abs(v) <= 65504.0f; });
    CHECK(in_range == (scale < 32768.0f));
    const auto non_finite = [](const std::vector<float>& v) {
      return std::count_if(v.begin(), v.end(), [](float x) { return !std::isfinite(x); });
    };
    cu::context ctx;
    device_array<fp16> gqkv(qkv), gdout(dout), gout(n * C), gdqkv(n * 3 * C), fout(n * C),
        fdqkv(std::vector<float>(n * 3 * C, 0.0f));
    device_array<float> glse(static_cast<std::size_t>(B) * NH * Tn),
        flse(static_cast<std::size_t>(B) * NH * Tn),
        scratch(static_cast<std::size_t>(cu::attention_scratch_floats(B, Tn, NH)));
    std::string why;
    if (cu::cudnn_attention_available(&why)) {
      cu::attention_cudnn_forward(ctx, gout.get(), glse.get(), gqkv.get(), B, Tn, C, NH);
      cu::attention_cudnn_backward(ctx, gdqkv.get(), gdout.get(), gqkv.get(), gout.get(),
                                   glse.get(), B, Tn, C, NH);
    }
    cu::attention_forward(ctx, fout.get(), flse.get(), gqkv.get(), B, Tn, C, NH);
    cu::attention_backward(ctx, fdqkv.get(), gdout.get(), gqkv.get(), fout.get(), flse.get(),
                           scratch.get(), B, Tn, C, NH);
    ctx.synchronize();
    INFO("dout scaled by " << scale << (why.empty() ? "" : "; cuDNN: " + why));
    if (why.empty()) CHECK((non_finite(gdqkv.host()) > 0) == !in_range);
    CHECK((non_finite(fdqkv.host()) > 0) == !in_range);
  }
}
