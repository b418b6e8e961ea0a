// Embedding kernels against a double-precision reference, finite differences and the
// accumulate (+=) convention. Tokens repeat on purpose so the scatter-add is exercised.
#include <catch2/catch.hpp>

#include "kernel_test_util.hpp"
#include "kernels/cpu_ops.hpp"

using namespace troupe::kernels;
using namespace troupe::kernels::test;

namespace {

constexpr int B = 2, T = 5, C = 8, Vp = 8;

struct fixture {
  std::mt19937 rng{1234};
  std::vector<std::int32_t> tokens{3, 1, 3, 0, 6, 6, 3, 2, 5, 1};
  std::vector<float> wte = random_vec(Vp * C, rng);
  std::vector<float> wpe = random_vec(T * C, rng);
  std::vector<float> dout = random_vec(B * T * C, rng);
};

}  // namespace

TEST_CASE("embedding forward and backward match the reference", "[embedding]") {
  fixture f;
  std::vector<float> out(B * T * C);
  embedding_forward(out.data(), f.tokens.data(), f.wte.data(), f.wpe.data(), B, T, C);

  std::vector<double> ref(B * T * C), dwte_ref(Vp * C, 0.0), dwpe_ref(T * C, 0.0);
  for (int b = 0; b < B; ++b) {
    for (int t = 0; t < T; ++t) {
      const int tok = f.tokens[b * T + t];
      for (int c = 0; c < C; ++c) {
        const int i = (b * T + t) * C + c;
        ref[i] = static_cast<double>(f.wte[tok * C + c]) + f.wpe[t * C + c];
        dwte_ref[tok * C + c] += f.dout[i];
        dwpe_ref[t * C + c] += f.dout[i];
      }
    }
  }
  CHECK(max_rel_error(out, ref) < 1e-6);

  std::vector<float> dwte(Vp * C, 0.0f), dwpe(T * C, 0.0f);
  embedding_backward(dwte.data(), dwpe.data(), f.dout.data(), f.tokens.data(), B, T, C);
  CHECK(max_rel_error(dwte, dwte_ref) < 1e-6);
  CHECK(max_rel_error(dwpe, dwpe_ref) < 1e-6);

  SECTION("backward accumulates") {
    embedding_backward(dwte.data(), dwpe.data(), f.dout.data(), f.tokens.data(), B, T, C);
    std::vector<double> twice_wte(dwte_ref), twice_wpe(dwpe_ref);
    for (auto& x : twice_wte) x *= 2;
    for (auto& x : twice_wpe) x *= 2;
    CHECK(max_rel_error(dwte, twice_wte) < 1e-6);
    CHECK(max_rel_error(dwpe, twice_wpe) < 1e-6);
  }
}

TEST_CASE("embedding gradients match finite differences", "[embedding]") {
  fixture f;
  const std::vector<float> w = random_vec(B * T * C, f.rng);
  std::vector<float> out(B * T * C);
  auto loss = [&] {
    embedding_forward(out.data(), f.tokens.data(), f.wte.data(), f.wpe.data(), B, T, C);
    return weighted_sum(out.data(), w);
  };
  std::vector<float> dwte(Vp * C, 0.0f), dwpe(T * C, 0.0f);
  embedding_backward(dwte.data(), dwpe.data(), w.data(), f.tokens.data(), B, T, C);
  CHECK(max_rel_error(dwte, finite_difference(loss, f.wte.data(), f.wte.size())) < 1e-2);
  CHECK(max_rel_error(dwpe, finite_difference(loss, f.wpe.data(), f.wpe.size())) < 1e-2);
}
