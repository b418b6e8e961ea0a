// Causal multi-head attention against a naive double-precision reference (forward: out and
// att probabilities, masked entries 0; backward: dq, dk, dv inside dqkv), finite differences
// on every qkv element and the accumulate (+=) convention.
#include <catch2/catch.hpp>

#include "kernel_test_util.hpp"
#include "kernels/cpu_ops.hpp"

using namespace troupe::kernels;
using namespace troupe::kernels::test;

namespace {

struct reference {
  std::vector<double> out, att, dqkv;
};

reference attention_reference(const std::vector<float>& qkv, const std::vector<float>& dout, int B,
                              int T, int C, int NH) {
  const int hs = C / NH;
  const double scale = 1.0 / std::sqrt(static_cast<double>(hs));
  reference r;
  r.out.assign(B * T * C, 0.0);
  r.att.assign(B * NH * T * T, 0.0);
  r.dqkv.assign(B * T * 3 * C, 0.0);
  auto q = [&](int b, int t, int h, int d) { return qkv[(b * T + t) * 3 * C + h * hs + d]; };
  auto k = [&](int b, int t, int h, int d) { return qkv[(b * T + t) * 3 * C + C + h * hs + d]; };
  auto v = [&](int b, int t, int h, int d) {
    return qkv[(b * T + t) * 3 * C + 2 * C + h * hs + d];
  };
  for (int b = 0; b < B; ++b) {
    for (int h = 0; h < NH; ++h) {
      std::vector<double> P(T * T, 0.0), dP(T * T, 0.0), dS(T * T, 0.0);
      for (int t = 0; t < T; ++t) {
        std::vector<double> s(t + 1);
        double mx = -1e300;
        for (int j = 0; j <= t; ++j) {
          double acc = 0;
          for (int d = 0; d < hs; ++d) acc += static_cast<double>(q(b, t, h, d)) * k(b, j, h, d);
          s[j] = acc * scale;
          mx = std::max(mx, s[j]);
        }
        double sum = 0;
        for (int j = 0; j <= t; ++j) sum += std::exp(s[j] - mx);
        for (int j = 0; j <= t; ++j) P[t * T + j] = std::exp(s[j] - mx) / sum;
        for (int d = 0; d < hs; ++d) {
          double acc = 0;
          for (int j = 0; j <= t; ++j) acc += P[t * T + j] * v(b, j, h, d);
          r.out[(b * T + t) * C + h * hs + d] = acc;
        }
      }
      for (int i = 0; i < T * T; ++i) r.att[(b * NH + h) * T * T + i] = P[i];
      // backward
      auto dO = [&](int t, int d) {
        return static_cast<double>(dout[(b * T + t) * C + h * hs + d]);
      };
      auto dq = [&](int t, int d) -> double& { return r.dqkv[(b * T + t) * 3 * C + h * hs + d]; };
      auto dk = [&](int t, int d) -> double& {
        return r.dqkv[(b * T + t) * 3 * C + C + h * hs + d];
      };
      auto dv = [&](int t, int d) -> double& {
        return r.dqkv[(b * T + t) * 3 * C + 2 * C + h * hs + d];
      };
      for (int t = 0; t < T; ++t) {
        for (int j = 0; j <= t; ++j) {
          for (int d = 0; d < hs; ++d) {
            dv(j, d) += P[t * T + j] * dO(t, d);
            dP[t * T + j] += dO(t, d) * v(b, j, h, d);
          }
        }
        double rowsum = 0;
        for (int j = 0; j <= t; ++j) rowsum += P[t * T + j] * dP[t * T + j];
        for (int j = 0; j <= t; ++j) dS[t * T + j] = P[t * T + j] * (dP[t * T + j] - rowsum);
        for (int j = 0; j <= t; ++j) {
          for (int d = 0; d < hs; ++d) {
            dq(t, d) += dS[t * T + j] * k(b, j, h, d) * scale;
            dk(j, d) += dS[t * T + j] * q(b, t, h, d) * scale;
          }
        }
      }
    }
  }
  return r;
}

}  // namespace

TEST_CASE("attention matches the reference", "[attention]") {
  struct shape {
    int B, T, C, NH;
  };
  const shape s = GENERATE(shape{2, 5, 8, 2}, shape{1, 33, 64, 4}, shape{2, 1, 6, 3});
  const int B = s.B, T = s.T, C = s.C, NH = s.NH;
  std::mt19937 rng(B * 1000 + T * 10 + C);
  auto qkv = random_vec(B * T * 3 * C, rng, -2.0f, 2.0f);
  auto dout = random_vec(B * T * C, rng);
  const reference ref = attention_reference(qkv, dout, B, T, C, NH);

  std::vector<float> out(B * T * C, 7.0f), att(B * NH * T * T, 7.0f);  // garbage in
  attention_forward(out.data(), att.data(), qkv.data(), B, T, C, NH);
  CHECK(max_rel_error(out, ref.out) < 1e-5);
  CHECK(max_rel_error(att, ref.att) < 1e-5);
  for (int bh = 0; bh < B * NH; ++bh) {
    for (int t = 0; t < T; ++t) {
      double rowsum = 0;
      for (int j = 0; j < T; ++j) {
        const float a = att[(bh * T + t) * T + j];
        if (j > t) CHECK(a == 0.0f);
        rowsum += a;
      }
      CHECK(rowsum == Approx(1.0).epsilon(1e-5));
    }
  }

  std::vector<float> dqkv(B * T * 3 * C, 0.0f);
  attention_backward(dqkv.data(), dout.data(), qkv.data(), att.data(), B, T, C, NH);
  CHECK(max_rel_error(dqkv, ref.dqkv) < 1e-5);

  attention_backward(dqkv.data(), dout.data(), qkv.data(), att.data(), B, T, C, NH);
  std::vector<double> twice(ref.dqkv);
  for (auto& x : twice) x *= 2;
  CHECK(max_rel_error(dqkv, twice) < 1e-5);
}

TEST_CASE("attention gradients match finite differences", "[attention]") {
  const int B = 2, T = 5, C = 8, NH = 2;
  std::mt19937 rng(21);
  auto qkv = random_vec(B * T * 3 * C, rng, -1.5f, 1.5f);
  const auto w = random_vec(B * T * C, rng);
  std::vector<float> out(B * T * C), att(B * NH * T * T);
  auto loss = [&] {
    attention_forward(out.data(), att.data(), qkv.data(), B, T, C, NH);
    return weighted_sum(out.data(), w);
  };
  loss();
  std::vector<float> dqkv(B * T * 3 * C, 0.0f);
  attention_backward(dqkv.data(), w.data(), qkv.data(), att.data(), B, T, C, NH);
  CHECK(max_rel_error(dqkv, finite_difference(loss, qkv.data(), qkv.size())) < 1e-2);
}
