// Every GPU op against the CPU reference (kernels/cpu), in fp32, bf16 and fp16, with a tolerance
// scaled by the dtype: inputs are rounded to the dtype first, so the difference left is the
// GPU's own (fp32: reduction order; bf16, fp16: rounded outputs and intermediates). Runs in the
// `gpu` suite; without a device the runner exits 77 (SKIP).
#include <catch2/catch.hpp>

#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>
#include <memory>
#include <random>
#include <thread>
#include <vector>

#include "kernels/cpu_ops.hpp"
#include "kernels/cuda/cuda_ops.hpp"
#include "kernels/cuda/paged_buffer.hpp"
#include "tests/kernels/cuda_test_util.hpp"

using namespace cuda_test;

// Layernorm against the CPU: the warp-per-row kernels, and the fast kernels' (128-bit loads, a row
// in registers) where the row fits them (C 768: 3 vectors a lane in bf16 and fp16, 6 in fp32;
// C 512) and the warp-per-row ones where it does not (C 100); outputs poisoned with NaN, dinp
// accumulated onto 0.5, the backward repeated bitwise.
TEMPLATE_TEST_CASE("layernorm on the GPU matches the CPU reference", "[gpu]", float, bf16, fp16) {
  for (const bool fast : {false, true})
    for (const int C : {768, 512, 100}) {
      const int N = 41;
      INFO("C = " << C << (fast ? ", fast kernels" : ""));
      const auto n = static_cast<std::size_t>(N) * C;
      const auto x = rounded<TestType>(random_values(n, 5, -2, 2));
      const auto w = random_values(C, 6, 0.5f, 1.5f), b = random_values(C, 7);
      const auto dy = rounded<TestType>(random_values(n, 8));
      std::vector<float> y(n), mean(N), rstd(N), dx(n, 0.5f), dw(C, 0.0f), db(C, 0.0f);
      cpu::layernorm_forward(y.data(), mean.data(), rstd.data(), x.data(), w.data(), b.data(), N,
                             C);
      cpu::layernorm_backward(dx.data(), dw.data(), db.data(), dy.data(), x.data(), w.data(),
                              mean.data(), rstd.data(), N, C);
      const float nan = std::numeric_limits<float>::quiet_NaN();
      cu::context ctx;
      ctx.set_fast_kernels(fast);
      device_array<TestType> gx(x), gy(std::vector<float>(n, nan)), gdy(dy),
          gdx(std::vector<float>(n, 0.5f));
      device_array<float> gw(w), gb(b), gmean(std::vector<float>(N, nan)),
          grstd(std::vector<float>(N, nan)), gdw(std::vector<float>(C, 0.0f)),
          gdb(std::vector<float>(C, 0.0f));
      cu::layernorm_forward(ctx, gy.get(), gmean.get(), grstd.get(), gx.get(), gw.get(), gb.get(),
                            N, C);
      cu::layernorm_backward(ctx, gdx.get(), gdw.get(), gdb.get(), gdy.get(), gx.get(), gw.get(),
                             gmean.get(), grstd.get(), N, C);
      ctx.synchronize();
      check_close<TestType>(gy.host(), y, "out");
      check_close<float>(gmean.host(), mean, "mean");
      check_close<float>(grstd.host(), rstd, "rstd", 1e-4);
      check_close<TestType>(gdx.host(), dx, "dinp (accumulated onto 0.5)", 1e-4);
      check_close<TestType>(gdw.host(), dw, "dweight", 1e-4);
      check_close<TestType>(gdb.host(), db, "dbias", 1e-4);
      // Deterministic: the same backward again gives the same bits.
      device_array<TestType> again(std::vector<float>(n, 0.5f));
      cu::layernorm_backward<TestType>(ctx, again.get(), nullptr, nullptr, gdy.get(), gx.get(),
                                       gw.get(), gmean.get(), grstd.get(), N, C);
      ctx.synchronize();
      CHECK(again.host() == gdx.host());
    }
}

// The residual add fused into the layernorm after it: bitwise residual_forward then
// layernorm_forward, with the fast kernels (one pass where the row fits: C 768 and 512) and
// without; the sum written over its first input (as the block writes res2 in place) and into a
// fresh buffer; outputs poisoned.
TEMPLATE_TEST_CASE("residual + layernorm on the GPU is the two ops bitwise", "[gpu]", float, bf16,
                   fp16) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  for (const bool fast : {false, true})
    for (const int C : {768, 512, 100})
      for (const bool in_place : {true, false}) {
        INFO("C = " << C << (fast ? ", fast kernels" : "") << (in_place ? ", in place" : ""));
        const int N = 37;
        const auto n = static_cast<std::size_t>(N) * C;
        const auto a = rounded<TestType>(random_values(n, 31, -2, 2));
        const auto b = rounded<TestType>(random_values(n, 32, -2, 2));
        const auto w = random_values(C, 33, 0.5f, 1.5f), bias = random_values(C, 34);
        cu::context ctx;
        ctx.set_fast_kernels(fast);
        device_array<TestType> ga(a), gb(b), gsum(std::vector<float>(n, nan)),
            gy(std::vector<float>(n, nan)), ref_sum(std::vector<float>(n, nan)),
            ref_y(std::vector<float>(n, nan));
        device_array<float> gw(w), gbias(bias), gmean(std::vector<float>(N, nan)),
            grstd(std::vector<float>(N, nan)), ref_mean(std::vector<float>(N, nan)),
            ref_rstd(std::vector<float>(N, nan));
        cu::residual_forward<TestType>(ctx, ref_sum.get(), ga.get(), gb.get(),
                                       static_cast<std::int64_t>(n));
        cu::layernorm_forward<TestType>(ctx, ref_y.get(), ref_mean.get(), ref_rstd.get(),
                                        ref_sum.get(), gw.get(), gbias.get(), N, C);
        TestType* sum = in_place ? ga.get() : gsum.get();
        cu::residual_layernorm_forward<TestType>(ctx, sum, gy.get(), gmean.get(), grstd.get(),
                                                 ga.get(), gb.get(), gw.get(), gbias.get(), N, C);
        ctx.synchronize();
        CHECK((in_place ? ga.host() : gsum.host()) == ref_sum.host());
        CHECK(gy.host() == ref_y.host());
        CHECK(gmean.host() == ref_mean.host());
        CHECK(grstd.host() == ref_rstd.host());
        // And the CPU's residual then layernorm.
        std::vector<float> r(n), y(n), mean(static_cast<std::size_t>(N)),
            rstd(static_cast<std::size_t>(N));
        cpu::residual_forward(r.data(), a.data(), b.data(), static_cast<std::int64_t>(n));
        const auto r_rounded = rounded<TestType>(r);
        cpu::layernorm_forward(y.data(), mean.data(), rstd.data(), r_rounded.data(), w.data(),
                               bias.data(), N, C);
        check_close<TestType>(gy.host(), y, "out");
        check_close<float>(gmean.host(), mean, "mean");
      }
}

// The GEMMs and bias: with the fast kernels in bf16 and fp16 the bias gradient comes from the
// weight-gradient GEMM's BGRADB epilogue (or the column sums, where cuBLASLt has no algorithm
// for it: OC 100). Gradients accumulated onto 0.5; the backward repeated bitwise.
TEMPLATE_TEST_CASE("linear (cuBLASLt) on the GPU matches the CPU reference", "[gpu]", float, bf16,
                   fp16) {
  for (const bool fast : {false, true})
    for (const int OC : {160, 100}) {
      INFO((fast ? "fast kernels" : "reference kernels") << ", OC " << OC);
      const int N = 64, C = 96;
      const auto x = rounded<TestType>(random_values(static_cast<std::size_t>(N) * C, 5));
      const auto w = rounded<TestType>(random_values(std::size_t(OC) * C, 6, -0.2f, 0.2f));
      const auto b = rounded<TestType>(random_values(OC, 7));
      const auto dy = rounded<TestType>(random_values(static_cast<std::size_t>(N) * OC, 8));
      std::vector<float> y(static_cast<std::size_t>(N) * OC), dx(x.size(), 0.5f),
          dw(w.size(), 0.5f), db(OC, 0.5f);
      cpu::linear_forward(y.data(), x.data(), w.data(), b.data(), N, C, OC);
      cpu::linear_backward(dx.data(), dw.data(), db.data(), dy.data(), x.data(), w.data(), N, C,
                           OC);
      const float nan = std::numeric_limits<float>::quiet_NaN();
      cu::context ctx;
      ctx.set_fast_kernels(fast);
      device_array<TestType> gx(x), gw(w), gb(b), gy(std::vector<float>(y.size(), nan)), gdy(dy),
          gdx(std::vector<float>(x.size(), 0.5f));
      device_array<float> gdw(std::vector<float>(w.size(), 0.5f)),
          gdb(std::vector<float>(OC, 0.5f));
      cu::linear_forward(ctx, gy.get(), gx.get(), gw.get(), gb.get(), N, C, OC);
      cu::linear_backward(ctx, gdx.get(), gdw.get(), gdb.get(), gdy.get(), gx.get(), gw.get(), N, C,
                          OC);
      ctx.synchronize();
      check_close<TestType>(gy.host(), y, "out", 1e-5);
      check_close<TestType>(gdx.host(), dx, "dinp (accumulated onto 0.5)", 1e-5);
      check_close<TestType>(gdw.host(), dw, "dweight (accumulated onto 0.5)", 1e-5);
      check_close<TestType>(gdb.host(), db, "dbias (accumulated onto 0.5)", 1e-5);
      if (ctx.unfused_epilogue_shapes() > 0)
        WARN("cuBLASLt has no BGRADB algorithm for OC " << OC << ": the column sums ran");
      // Accumulates, deterministically: a second backward onto the first's gradients adds the
      // same bits again (the first's increments, recomputed from fresh accumulators, equal).
      device_array<float> dw2(std::vector<float>(w.size(), 0.5f)),
          db2(std::vector<float>(OC, 0.5f));
      cu::linear_backward<TestType>(ctx, nullptr, dw2.get(), db2.get(), gdy.get(), gx.get(),
                                    gw.get(), N, C, OC);
      ctx.synchronize();
      CHECK(dw2.host() == gdw.host());
      CHECK(db2.host() == gdb.host());
      cu::linear_backward<TestType>(ctx, nullptr, gdw.get(), gdb.get(), gdy.get(), gx.get(),
                                    gw.get(), N, C, OC);
      ctx.synchronize();
      for (auto& v : dw) v = 2 * v - 0.5f;
      for (auto& v : db) v = 2 * v - 0.5f;
      check_close<TestType>(gdw.host(), dw, "dweight accumulated twice", 1e-5);
      check_close<TestType>(gdb.host(), db, "dbias accumulated twice", 1e-5);
    }
}

// The MLP's linear + GELU and its backward against the CPU's ops one after another: the
// unfused ops, and with the fast kernels cuBLASLt's GELU_AUX_BIAS and DGELU epilogues (or the
// unfused ops where cuBLASLt has no algorithm for a shape: width 100). Outputs poisoned; dpre
// overwritten, the weight and bias gradients accumulated.
TEMPLATE_TEST_CASE("linear + GELU on the GPU matches the CPU reference", "[gpu]", float, bf16,
                   fp16) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  for (const bool fast : {false, true})
    for (const int OC : {160, 100}) {
      INFO((fast ? "fast kernels" : "unfused") << ", OC " << OC);
      const int N = 64, C = 96;
      const auto n_out = static_cast<std::size_t>(N) * OC;
      // Forward: x[N,C] -> pre, out[N,OC].
      const auto x = rounded<TestType>(random_values(static_cast<std::size_t>(N) * C, 21));
      const auto w = rounded<TestType>(random_values(std::size_t(OC) * C, 22, -0.3f, 0.3f));
      const auto b = rounded<TestType>(random_values(OC, 23));
      std::vector<float> pre(n_out), out(n_out);
      cpu::linear_forward(pre.data(), x.data(), w.data(), b.data(), N, C, OC);
      cpu::gelu_forward(out.data(), pre.data(), static_cast<std::int64_t>(n_out));
      cu::context ctx;
      ctx.set_fast_kernels(fast);
      device_array<TestType> gx(x), gw(w), gb(b), gpre(std::vector<float>(n_out, nan)),
          gout(std::vector<float>(n_out, nan));
      cu::linear_gelu_forward(ctx, gout.get(), gpre.get(), gx.get(), gw.get(), gb.get(), N, C, OC);
      ctx.synchronize();
      check_close<TestType>(gpre.host(), pre, "pre", 1e-5);
      check_close<TestType>(gout.host(), out, "gelu(pre)", 1e-5);
      // Backward of the next linear act[N,OC] -> y[N,C2], act = gelu(pre2): dpre2[N,OC].
      const int C2 = 48;
      const auto pre2 = rounded<TestType>(random_values(n_out, 24, -4, 4));
      std::vector<float> act(n_out);
      cpu::gelu_forward(act.data(), pre2.data(), static_cast<std::int64_t>(n_out));
      const auto act_r = rounded<TestType>(act);
      const auto w2 = rounded<TestType>(random_values(std::size_t(C2) * OC, 25, -0.3f, 0.3f));
      const auto dy = rounded<TestType>(random_values(static_cast<std::size_t>(N) * C2, 26));
      std::vector<float> dact(n_out, 0.0f), dpre(n_out, 0.0f), dw(w2.size(), 0.5f), db(C2, 0.5f);
      cpu::linear_backward(dact.data(), dw.data(), db.data(), dy.data(), act_r.data(), w2.data(), N,
                           OC, C2);
      cpu::gelu_backward(dpre.data(), pre2.data(), dact.data(), static_cast<std::int64_t>(n_out));
      device_array<TestType> gpre2(pre2), gact(act_r), gw2(w2), gdy(dy),
          gdpre(std::vector<float>(n_out, nan)), gdact(std::vector<float>(n_out, nan));
      device_array<float> gdw(std::vector<float>(w2.size(), 0.5f)),
          gdb(std::vector<float>(C2, 0.5f));
      cu::linear_backward_dgelu(ctx, gdpre.get(), gdact.get(), gdw.get(), gdb.get(), gdy.get(),
                                gact.get(), gpre2.get(), gw2.get(), N, OC, C2);
      ctx.synchronize();
      check_close<TestType>(gdpre.host(), dpre, "dpre (overwritten)", 1e-5);
      check_close<TestType>(gdw.host(), dw, "dweight (accumulated onto 0.5)", 1e-5);
      check_close<TestType>(gdb.host(), db, "dbias (accumulated onto 0.5)", 1e-5);
    }
}

// The scalar kernels, and the fast kernels' 16-byte packs: n no multiple of a pack (the last
// thread takes the tail), and a view one element in (unaligned: the scalar kernel again).
TEMPLATE_TEST_CASE("GELU and residual on the GPU match the CPU reference", "[gpu]", float, bf16,
                   fp16) {
  for (const bool fast : {false, true})
    for (const std::int64_t offset : {0, 1}) {
      INFO((fast ? "fast kernels" : "scalar kernels") << ", offset " << offset);
      const std::int64_t n = 100003;
      auto x = random_values(static_cast<std::size_t>(n), 9, -4, 4);
      // Far tails too: exp(-2u) overflowed to inf below x = -10.1 and the backward gave NaN.
      for (float v : {-12.0f, -30.0f, -200.0f, 12.0f, 30.0f, 200.0f}) x.push_back(v);
      x = rounded<TestType>(x);
      x.resize(static_cast<std::size_t>(n));
      std::copy(x.end() - 6, x.end(), x.begin());
      const auto y2 = rounded<TestType>(random_values(static_cast<std::size_t>(n), 10));
      const auto dy = rounded<TestType>(random_values(static_cast<std::size_t>(n), 11));
      std::vector<float> y(static_cast<std::size_t>(n)), dx(static_cast<std::size_t>(n), 0.5f),
          r(static_cast<std::size_t>(n));
      cpu::gelu_forward(y.data(), x.data(), n);
      cpu::gelu_backward(dx.data(), x.data(), dy.data(), n);
      cpu::residual_forward(r.data(), x.data(), y2.data(), n);
      const float nan = std::numeric_limits<float>::quiet_NaN();
      // Each array one element longer, poisoned, viewed from `offset`.
      const auto padded = [&](const std::vector<float>& v, float fill) {
        std::vector<float> out(v.size() + 1, fill);
        std::copy(v.begin(), v.end(), out.begin() + offset);
        return out;
      };
      const std::vector<float> poison(static_cast<std::size_t>(n), nan);
      cu::context ctx;
      ctx.set_fast_kernels(fast);
      device_array<TestType> gx(padded(x, nan)), gy(padded(poison, nan)), gdy(padded(dy, nan)),
          gdx(padded(std::vector<float>(static_cast<std::size_t>(n), 0.5f), nan)),
          g2(padded(y2, nan)), gr(padded(poison, nan));
      cu::gelu_forward(ctx, gy.get() + offset, gx.get() + offset, n);
      cu::gelu_backward(ctx, gdx.get() + offset, gx.get() + offset, gdy.get() + offset, n);
      cu::residual_forward(ctx, gr.get() + offset, gx.get() + offset, g2.get() + offset, n);
      ctx.synchronize();
      const auto view = [&](const std::vector<float>& v) {
        return std::vector<float>(v.begin() + offset, v.begin() + offset + n);
      };
      check_close<TestType>(view(gy.host()), y, "gelu");
      check_close<TestType>(view(gdx.host()), dx, "gelu backward (accumulated onto 0.5)");
      check_close<TestType>(view(gr.host()), r, "residual");
      for (float v : view(gdx.host())) REQUIRE(std::isfinite(v));
      // Nothing written outside the view: the poison is still there.
      const auto outside = offset == 0 ? std::size_t(n) : std::size_t{0};
      CHECK(std::isnan(gy.host()[outside]));
      CHECK(std::isnan(gr.host()[outside]));
      // Empty inputs launch nothing (a grid of 0 blocks would be an invalid launch).
      cu::gelu_forward(ctx, gy.get(), gx.get(), 0);
      cu::gelu_backward(ctx, gdx.get(), gx.get(), gdy.get(), 0);
      cu::residual_forward(ctx, gr.get(), gx.get(), g2.get(), 0);
      ctx.synchronize();
    }
}

// The scalar kernel, and the fast kernels' one (the row read once for its maximum and sum, in
// 16-byte packs); dlogits in place of the logits, and apart, poisoned.
TEMPLATE_TEST_CASE("fused softmax cross-entropy on the GPU matches the CPU reference", "[gpu]",
                   float, bf16, fp16) {
  const int N = 19, V = 50257, Vp = 50304, ignore = -100;
  const auto logits = rounded<TestType>(random_values(static_cast<std::size_t>(N) * Vp, 12, -6, 6));
  std::vector<std::int32_t> targets(N);
  std::mt19937 rng(13);
  for (int i = 0; i < N; ++i) targets[i] = i % 5 == 4 ? ignore : int(rng() % V);
  targets[0] = V - 1;  // the last real column: in the last pack, beside the padding
  std::int64_t count = 0;
  for (int t : targets) count += t != ignore;
  std::vector<float> dlogits(logits.size());
  const auto want = cpu::softmax_cross_entropy_backward(dlogits.data(), logits.data(),
                                                        targets.data(), N, V, Vp, ignore, 2.0f);
  std::int32_t* gt = nullptr;
  REQUIRE(cudaMalloc(reinterpret_cast<void**>(&gt), N * sizeof(std::int32_t)) == cudaSuccess);
  REQUIRE(cudaMemcpy(gt, targets.data(), N * sizeof(std::int32_t), cudaMemcpyHostToDevice) ==
          cudaSuccess);
  for (const bool fast : {false, true})
    for (const bool in_place : {true, false}) {
      INFO((fast ? "fast kernels" : "scalar kernel") << (in_place ? ", in place" : ", apart"));
      cu::context ctx;
      ctx.set_fast_kernels(fast);
      device_array<TestType> gl(logits),
          gd(std::vector<float>(logits.size(), std::numeric_limits<float>::quiet_NaN()));
      device_array<float> glosses(static_cast<std::size_t>(N));
      TestType* out = in_place ? gl.get() : gd.get();
      const auto got = cu::softmax_cross_entropy_backward(ctx, out, gl.get(), gt, glosses.get(), N,
                                                          V, Vp, ignore, count, 2.0f);
      CHECK(got.count == want.count);
      CHECK(std::abs(got.loss_sum - want.loss_sum) <= 1e-4 * std::abs(want.loss_sum));
      check_close<TestType>(in_place ? gl.host() : gd.host(), dlogits, "dlogits", 1e-4);
    }
  cudaFree(gt);
}

TEST_CASE("AdamW on the GPU is the CPU kernel's arithmetic, with unscaling folded in", "[gpu]") {
  const std::int64_t n = 70001;
  auto p = random_values(static_cast<std::size_t>(n), 14),
       g = random_values(static_cast<std::size_t>(n), 15, -0.1f, 0.1f);
  auto m = random_values(static_cast<std::size_t>(n), 16, -0.01f, 0.01f);
  auto v = random_values(static_cast<std::size_t>(n), 17, 0.0f, 1e-4f);
  cpu::adamw_hparams hp{3e-4f, 0.9f, 0.95f, 1e-8f, 0.1f};
  const auto p0 = p, m0 = m, v0 = v;  // the state before the CPU update
  cu::context ctx;
  device_array<float> gp(p), gm(m), gv(v);
  std::vector<float> doubled(g);
  for (auto& x : doubled) x *= 2;  // the loss scale 2, unscaled by grad_scale 0.5 on the GPU
  device_array<float> gg(doubled);
  device_array<bf16> copy(static_cast<std::size_t>(n));
  cpu::adamw_update(p.data(), g.data(), m.data(), v.data(), n, hp, 7, true);
  cu::adamw_update(ctx, gp.get(), gg.get(), gm.get(), gv.get(), n, hp, 7, true, 0.5f, copy.get());
  ctx.synchronize();
  check_close<float>(gp.host(), p, "param", 1e-6);
  check_close<float>(gm.host(), m, "m", 1e-6);
  check_close<float>(gv.host(), v, "v", 1e-6);
  check_close<bf16>(copy.host(), p, "bf16 copy");
  // The same update with an fp16 working copy (fp16 training).
  device_array<float> gp16(p0), gm16(m0), gv16(v0);
  device_array<fp16> copy16(static_cast<std::size_t>(n));
  cu::adamw_update(ctx, gp16.get(), gg.get(), gm16.get(), gv16.get(), n, hp, 7, true, 0.5f,
                   copy16.get());
  ctx.synchronize();
  CHECK(gp16.host() == gp.host());
  check_close<fp16>(copy16.host(), p, "fp16 copy");
}

// One launch over a flat buffer of parameters (the fast kernels' AdamW) is bitwise each
// parameter's own launch, decay or not, with a bf16 and without a working copy.
TEST_CASE("AdamW over the flat buffer in one launch is bitwise the per-tensor updates", "[gpu]") {
  const std::vector<cu::adamw_segments::segment> segments = {
      {0, 1000, true}, {1000, 7, false}, {1007, 4096, true}, {5103, 1, false}, {5104, 3001, true}};
  const std::int64_t n = 8105;
  const auto p = random_values(static_cast<std::size_t>(n), 24);
  const auto g = random_values(static_cast<std::size_t>(n), 25, -0.1f, 0.1f);
  const auto m = random_values(static_cast<std::size_t>(n), 26, -0.01f, 0.01f);
  const auto v = random_values(static_cast<std::size_t>(n), 27, 0.0f, 1e-4f);
  cpu::adamw_hparams hp{3e-4f, 0.9f, 0.95f, 1e-8f, 0.1f};
  cu::context ctx;
  cu::adamw_segments table;
  table.upload(ctx, segments);
  CHECK(table.total() == n);
  CHECK(table.count() == 5);
  device_array<float> gg(g);
  for (const bool with_copy : {true, false}) {
    INFO("bf16 copy: " << with_copy);
    device_array<float> fp(p), fm(m), fv(v), sp(p), sm(m), sv(v);
    device_array<bf16> fcopy(static_cast<std::size_t>(n)), scopy(static_cast<std::size_t>(n));
    cu::adamw_update_flat(ctx, fp.get(), gg.get(), fm.get(), fv.get(), table, hp, 3, 0.5f,
                          with_copy ? fcopy.get() : nullptr);
    for (const auto& seg : segments)
      cu::adamw_update(ctx, sp.get() + seg.offset, gg.get() + seg.offset, sm.get() + seg.offset,
                       sv.get() + seg.offset, seg.numel, hp, 3, seg.decay, 0.5f,
                       with_copy ? scopy.get() + seg.offset : nullptr);
    ctx.synchronize();
    CHECK(fp.host() == sp.host());
    CHECK(fm.host() == sm.host());
    CHECK(fv.host() == sv.host());
    if (with_copy) CHECK(fcopy.host() == scopy.host());
  }
  cu::adamw_segments gap;
  CHECK_THROWS_AS(gap.upload(ctx, {{0, 10, true}, {11, 5, false}}), std::invalid_argument);
}

TEST_CASE("the GPU sum of squares matches the CPU gradient norm and repeats bitwise", "[gpu]") {
  const std::int64_t n = 3'000'017;
  auto x = random_values(static_cast<std::size_t>(n), 18);
  const cpu::gradient_span span{x.data(), n};
  const double want = cpu::global_grad_norm({&span, 1});
  cu::context ctx;
  device_array<float> gx(x);
  const double got = cu::square_sum(ctx, gx.get(), n);
  CHECK(std::abs(std::sqrt(got) - want) <= 1e-12 * want);
  CHECK(cu::square_sum(ctx, gx.get(), n) == got);
  // Several spans at once (ZeRO's owned segments): each bitwise its own square_sum.
  const std::vector<std::pair<const float*, std::int64_t>> spans = {
      {gx.get(), 1}, {gx.get() + 7, 0}, {gx.get() + 100, 262'145}, {gx.get() + 5, n - 5}};
  const auto sums = cu::square_sums(ctx, spans);
  REQUIRE(sums.size() == spans.size());
  for (std::size_t i = 0; i < spans.size(); ++i)
    CHECK(sums[i] == cu::square_sum(ctx, spans[i].first, spans[i].second));
}

// ZeRO-3's paged parameter buffers (gpu_chunk with paged_parameters): a granule is mapped while
// any byte of it is held, unmapped once the stream has passed its release, and what stayed held
// keeps its values.
TEST_CASE("a paged buffer maps granules while they are held", "[gpu]") {
  cu::context ctx;
  const std::size_t G = cu::paged_buffer(0, 1).granularity();
  REQUIRE(G > 0);
  const std::size_t bytes = 5 * G + 123, floats = bytes / sizeof(float);
  cu::paged_buffer buf(0, bytes);
  CHECK(buf.mapped_bytes() == 6 * G);
  auto* p = static_cast<float*>(buf.data());
  const auto values = random_values(floats, 3);
  REQUIRE(cudaMemcpy(p, values.data(), floats * sizeof(float), cudaMemcpyHostToDevice) ==
          cudaSuccess);
  // Granules 0 and 1 wholly, granule 2 in part: 0 and 1 go once the stream passed the release.
  buf.release(0, 2 * G + 16, ctx.stream());
  ctx.synchronize();
  CHECK(buf.mapped_bytes() == 4 * G);
  buf.acquire(0, 2 * G + 16);
  CHECK(buf.mapped_bytes() == 6 * G);
  std::vector<float> back(floats);
  REQUIRE(cudaMemcpy(back.data(), p, floats * sizeof(float), cudaMemcpyDeviceToHost) ==
          cudaSuccess);
  const std::size_t kept = (2 * G + 16) / sizeof(float);
  CHECK(std::equal(back.begin() + static_cast<std::ptrdiff_t>(kept), back.end(),
                   values.begin() + static_cast<std::ptrdiff_t>(kept)));
  // The acquired range is writable again.
  const std::vector<float> ones(kept, 1.0f);
  REQUIRE(cudaMemcpy(p, ones.data(), kept * sizeof(float), cudaMemcpyHostToDevice) == cudaSuccess);
  REQUIRE(cudaMemcpy(back.data(), p, kept * sizeof(float), cudaMemcpyDeviceToHost) == cudaSuccess);
  CHECK(std::equal(ones.begin(), ones.end(), back.begin()));
  // Acquired again before the stream passed the release: the mapping and values stay. The
  // stream is held at a gate (a host function waiting for the test) so that it cannot pass the
  // release before the acquire, however fast the device.
  std::atomic<bool> open{false};
  REQUIRE(cudaLaunchHostFunc(
              ctx.stream(),
              [](void* gate) {
                while (!static_cast<std::atomic<bool>*>(gate)->load()) std::this_thread::yield();
              },
              &open) == cudaSuccess);
  buf.release(3 * G, G, ctx.stream());
  buf.acquire(3 * G, G);
  open = true;
  ctx.synchronize();
  CHECK(buf.mapped_bytes() == 6 * G);
  REQUIRE(cudaMemcpy(back.data(), p, floats * sizeof(float), cudaMemcpyDeviceToHost) ==
          cudaSuccess);
  CHECK(std::equal(back.begin() + static_cast<std::ptrdiff_t>(kept), back.end(),
                   values.begin() + static_cast<std::ptrdiff_t>(kept)));
  CHECK_THROWS_WITH(buf.acquire(0, 16), Catch::Contains("acquired twice"));
  CHECK_THROWS_WITH(buf.release(bytes - 4, 8, ctx.stream()), Catch::Contains("outside"));
}

TEST_CASE("the replicas' mean on one device sums in replica order, into every copy", "[gpu]") {
  const std::int64_t n = 100'003;
  cu::context ctx;
  for (int k : {1, 2, 3, 5}) {
    INFO(k << " replicas");
    std::vector<std::vector<float>> x;
    std::vector<std::unique_ptr<device_array<float>>> copies;
    std::vector<float*> pointers;
    for (int d = 0; d < k; ++d) {
      x.push_back(random_values(static_cast<std::size_t>(n), 40 + static_cast<std::uint32_t>(d)));
      copies.push_back(std::make_unique<device_array<float>>(x.back()));
      pointers.push_back(copies.back()->get());
    }
    cu::replica_mean(ctx.stream(), pointers.data(), k, n);
    std::vector<float> want(static_cast<std::size_t>(n));
    const float scale = 1.0f / static_cast<float>(k);
    for (std::size_t i = 0; i < want.size(); ++i) {
      float sum = x[0][i];
      for (int d = 1; d < k; ++d) sum = sum + x[static_cast<std::size_t>(d)][i];
      want[i] = k == 1 ? x[0][i] : sum * scale;
    }
    for (const auto& c : copies) CHECK(c->host() == want);
  }
  float* none[1] = {nullptr};
  CHECK_THROWS_WITH(cu::replica_mean(ctx.stream(), none, cu::kMaxLocalReplicas + 1, 1),
                    Catch::Contains("replicas"));
}
