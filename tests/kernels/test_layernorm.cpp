// LayerNorm kernels against a double-precision reference (eps 1e-5, biased variance), finite
// differences for input, weight and bias, and the accumulate (+=) convention.
#include <catch2/catch.hpp>

#include "kernel_test_util.hpp"
#include "kernels/cpu_ops.hpp"

using namespace troupe::kernels;
using namespace troupe::kernels::test;

namespace {

struct reference {
  std::vector<double> out, mean, rstd, dinp, dweight, dbias;
};

// Plain double-precision LayerNorm forward and backward.
reference layernorm_reference(const std::vector<float>& inp, const std::vector<float>& weight,
                              const std::vector<float>& bias, const std::vector<float>& dout, int N,
                              int C) {
  reference r;
  r.out.assign(N * C, 0.0);
  r.mean.assign(N, 0.0);
  r.rstd.assign(N, 0.0);
  r.dinp.assign(N * C, 0.0);
  r.dweight.assign(C, 0.0);
  r.dbias.assign(C, 0.0);
  for (int n = 0; n < N; ++n) {
    const float* x = &inp[n * C];
    double m = 0;
    for (int c = 0; c < C; ++c) m += x[c];
    m /= C;
    double var = 0;
    for (int c = 0; c < C; ++c) var += (x[c] - m) * (x[c] - m);
    var /= C;
    const double rs = 1.0 / std::sqrt(var + 1e-5);
    r.mean[n] = m;
    r.rstd[n] = rs;
    std::vector<double> xhat(C), dxhat(C);
    for (int c = 0; c < C; ++c) {
      xhat[c] = (x[c] - m) * rs;
      r.out[n * C + c] = xhat[c] * weight[c] + bias[c];
      dxhat[c] = static_cast<double>(dout[n * C + c]) * weight[c];
      r.dweight[c] += dout[n * C + c] * xhat[c];
      r.dbias[c] += dout[n * C + c];
    }
    double sum_dxhat = 0, sum_dxhat_xhat = 0;
    for (int c = 0; c < C; ++c) {
      sum_dxhat += dxhat[c];
      sum_dxhat_xhat += dxhat[c] * xhat[c];
    }
    for (int c = 0; c < C; ++c) {
      r.dinp[n * C + c] = rs * (dxhat[c] - sum_dxhat / C - xhat[c] * sum_dxhat_xhat / C);
    }
  }
  return r;
}

}  // namespace

TEST_CASE("layernorm matches the reference", "[layernorm]") {
  const int N = GENERATE(10, 3);
  const int C = GENERATE(8, 37);
  std::mt19937 rng(42 + N * 100 + C);
  auto inp = random_vec(N * C, rng, -2.0f, 3.0f);
  auto weight = random_vec(C, rng, 0.5f, 1.5f);
  auto bias = random_vec(C, rng);
  auto dout = random_vec(N * C, rng);
  const reference ref = layernorm_reference(inp, weight, bias, dout, N, C);

  std::vector<float> out(N * C), mean(N), rstd(N);
  layernorm_forward(out.data(), mean.data(), rstd.data(), inp.data(), weight.data(), bias.data(), N,
                    C);
  CHECK(max_rel_error(out, ref.out) < 1e-5);
  CHECK(max_rel_error(mean, ref.mean) < 1e-5);
  CHECK(max_rel_error(rstd, ref.rstd) < 1e-5);

  std::vector<float> dinp(N * C, 0.0f), dweight(C, 0.0f), dbias(C, 0.0f);
  layernorm_backward(dinp.data(), dweight.data(), dbias.data(), dout.data(), inp.data(),
                     weight.data(), mean.data(), rstd.data(), N, C);
  CHECK(max_rel_error(dinp, ref.dinp) < 1e-5);
  CHECK(max_rel_error(dweight, ref.dweight) < 1e-5);
  CHECK(max_rel_error(dbias, ref.dbias) < 1e-5);

  // Accumulate: a second call doubles every gradient.
  const auto dinp1 = dinp, dweight1 = dweight, dbias1 = dbias;
  layernorm_backward(dinp.data(), dweight.data(), dbias.data(), dout.data(), inp.data(),
                     weight.data(), mean.data(), rstd.data(), N, C);
  for (int i = 0; i < N * C; ++i) CHECK(dinp[i] == Approx(2 * dinp1[i]).margin(1e-6));
  for (int c = 0; c < C; ++c) {
    CHECK(dweight[c] == Approx(2 * dweight1[c]).margin(1e-6));
    CHECK(dbias[c] == Approx(2 * dbias1[c]).margin(1e-6));
  }
}

TEST_CASE("layernorm gradients match finite differences", "[layernorm]") {
  const int N = 6, C = 8;
  std::mt19937 rng(7);
  auto inp = random_vec(N * C, rng, -2.0f, 2.0f);
  auto weight = random_vec(C, rng, 0.5f, 1.5f);
  auto bias = random_vec(C, rng);
  const auto w = random_vec(N * C, rng);
  std::vector<float> out(N * C), mean(N), rstd(N);
  auto loss = [&] {
    layernorm_forward(out.data(), mean.data(), rstd.data(), inp.data(), weight.data(), bias.data(),
                      N, C);
    return weighted_sum(out.data(), w);
  };
  loss();
  std::vector<float> dinp(N * C, 0.0f), dweight(C, 0.0f), dbias(C, 0.0f);
  layernorm_backward(dinp.data(), dweight.data(), dbias.data(), w.data(), inp.data(), weight.data(),
                     mean.data(), rstd.data(), N, C);
  CHECK(max_rel_error(dinp, finite_difference(loss, inp.data(), inp.size())) < 1e-2);
  CHECK(max_rel_error(dweight, finite_difference(loss, weight.data(), weight.size())) < 1e-2);
  CHECK(max_rel_error(dbias, finite_difference(loss, bias.data(), bias.size())) < 1e-2);
}
