// Linear kernels (weight [OC, C]) against a triple-loop double reference, with and without
// bias, nullptr gradients, finite differences and the accumulate (+=) convention.
#include <catch2/catch.hpp>

#include "kernel_test_util.hpp"
#include "kernels/cpu_ops.hpp"

using namespace troupe::kernels;
using namespace troupe::kernels::test;

TEST_CASE("linear matches the reference", "[linear]") {
  struct shape {
    int N, C, OC;
  };
  const shape s = GENERATE(shape{10, 8, 12}, shape{37, 300, 65});
  const bool with_bias = GENERATE(true, false);
  const int N = s.N, C = s.C, OC = s.OC;
  std::mt19937 rng(N * 7 + C + (with_bias ? 1 : 0));
  auto inp = random_vec(N * C, rng);
  auto weight = random_vec(OC * C, rng);
  auto bias = random_vec(OC, rng);
  auto dout = random_vec(N * OC, rng);
  const float* bptr = with_bias ? bias.data() : nullptr;

  std::vector<double> ref(N * OC), dinp_ref(N * C, 0.0), dw_ref(OC * C, 0.0), db_ref(OC, 0.0);
  for (int n = 0; n < N; ++n) {
    for (int o = 0; o < OC; ++o) {
      double acc = with_bias ? bias[o] : 0.0;
      for (int c = 0; c < C; ++c) acc += static_cast<double>(inp[n * C + c]) * weight[o * C + c];
      ref[n * OC + o] = acc;
      const double g = dout[n * OC + o];
      db_ref[o] += g;
      for (int c = 0; c < C; ++c) {
        dinp_ref[n * C + c] += g * weight[o * C + c];
        dw_ref[o * C + c] += g * inp[n * C + c];
      }
    }
  }

  std::vector<float> out(N * OC, 123.0f);  // garbage: forward must overwrite
  linear_forward(out.data(), inp.data(), weight.data(), bptr, N, C, OC);
  CHECK(max_rel_error(out, ref) < 1e-5);

  // Start from non-zero gradients: the kernel must add to them.
  auto dinp0 = random_vec(N * C, rng), dw0 = random_vec(OC * C, rng), db0 = random_vec(OC, rng);
  auto dinp = dinp0, dw = dw0, db = db0;
  linear_backward(dinp.data(), dw.data(), db.data(), dout.data(), inp.data(), weight.data(), N, C,
                  OC);
  for (int i = 0; i < N * C; ++i) dinp[i] -= dinp0[i];
  for (int i = 0; i < OC * C; ++i) dw[i] -= dw0[i];
  for (int i = 0; i < OC; ++i) db[i] -= db0[i];
  CHECK(max_rel_error(dinp, dinp_ref) < 1e-5);
  CHECK(max_rel_error(dw, dw_ref) < 1e-5);
  CHECK(max_rel_error(db, db_ref) < 1e-5);

  SECTION("backward twice doubles the gradients") {
    std::vector<float> gi(N * C, 0.0f), gw(OC * C, 0.0f), gb(OC, 0.0f);
    for (int rep = 0; rep < 2; ++rep) {
      linear_backward(gi.data(), gw.data(), gb.data(), dout.data(), inp.data(), weight.data(), N, C,
                      OC);
    }
    for (auto* v : {&dinp_ref, &dw_ref, &db_ref}) {
      for (auto& x : *v) x *= 2;
    }
    CHECK(max_rel_error(gi, dinp_ref) < 1e-5);
    CHECK(max_rel_error(gw, dw_ref) < 1e-5);
    CHECK(max_rel_error(gb, db_ref) < 1e-5);
  }

  SECTION("nullptr gradients are skipped") {
    std::vector<float> gw(OC * C, 0.0f);
    linear_backward(nullptr, gw.data(), nullptr, dout.data(), inp.data(), weight.data(), N, C, OC);
    CHECK(max_rel_error(gw, dw_ref) < 1e-5);
    std::vector<float> gi(N * C, 0.0f);
    linear_backward(gi.data(), nullptr, nullptr, dout.data(), inp.data(), weight.data(), N, C, OC);
    CHECK(max_rel_error(gi, dinp_ref) < 1e-5);
    std::vector<float> gb(OC, 0.0f);
    linear_backward(nullptr, nullptr, gb.data(), dout.data(), inp.data(), weight.data(), N, C, OC);
    CHECK(max_rel_error(gb, db_ref) < 1e-5);
  }
}

TEST_CASE("linear gradients match finite differences", "[linear]") {
  const int N = 4, C = 6, OC = 5;
  std::mt19937 rng(99);
  auto inp = random_vec(N * C, rng);
  auto weight = random_vec(OC * C, rng);
  auto bias = random_vec(OC, rng);
  const auto w = random_vec(N * OC, rng);
  std::vector<float> out(N * OC);
  auto loss = [&] {
    linear_forward(out.data(), inp.data(), weight.data(), bias.data(), N, C, OC);
    return weighted_sum(out.data(), w);
  };
  std::vector<float> dinp(N * C, 0.0f), dw(OC * C, 0.0f), db(OC, 0.0f);
  linear_backward(dinp.data(), dw.data(), db.data(), w.data(), inp.data(), weight.data(), N, C, OC);
  CHECK(max_rel_error(dinp, finite_difference(loss, inp.data(), inp.size())) < 1e-2);
  CHECK(max_rel_error(dw, finite_difference(loss, weight.data(), weight.size())) < 1e-2);
  CHECK(max_rel_error(db, finite_difference(loss, bias.data(), bias.size())) < 1e-2);
}
