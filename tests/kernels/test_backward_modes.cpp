// The nullptr modes of the backward kernels that split backward (B/W) uses, against the full
// call: an input-only call plus a weight-only call give the full call's gradients bitwise, and
// a part left out (nullptr) is neither computed nor written. Gradients start non-zero, so the
// accumulate (+=) convention is covered too.
#include <catch2/catch.hpp>

#include <cstring>

#include "kernel_test_util.hpp"
#include "kernels/cpu_ops.hpp"

using namespace troupe::kernels;
using namespace troupe::kernels::test;

namespace {

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

}  // namespace

TEST_CASE("linear backward: input-only + weight-only calls equal the full call",
          "[linear][backward_modes]") {
  struct shape {
    int N, C, OC;
  };
  // The larger shape takes OpenBLAS past its small-matrix and single-thread thresholds.
  const shape s = GENERATE(shape{10, 8, 24}, shape{130, 96, 288});
  const int N = s.N, C = s.C, OC = s.OC;
  std::mt19937 rng(N + C + OC);
  const auto inp = random_vec(N * C, rng), weight = random_vec(OC * C, rng);
  const auto dout = random_vec(N * OC, rng);
  const auto dinp0 = random_vec(N * C, rng), dw0 = random_vec(OC * C, rng);
  const auto db0 = random_vec(OC, rng);

  auto dinp_full = dinp0, dw_full = dw0, db_full = db0;
  linear_backward(dinp_full.data(), dw_full.data(), db_full.data(), dout.data(), inp.data(),
                  weight.data(), N, C, OC);

  auto dinp = dinp0, dw = dw0, db = db0;
  linear_backward(dinp.data(), nullptr, nullptr, dout.data(), inp.data(), weight.data(), N, C, OC);
  CHECK(same_bits(dinp, dinp_full));
  CHECK(same_bits(dw, dw0));  // untouched
  CHECK(same_bits(db, db0));
  linear_backward(nullptr, dw.data(), db.data(), dout.data(), inp.data(), weight.data(), N, C, OC);
  CHECK(same_bits(dinp, dinp_full));
  CHECK(same_bits(dw, dw_full));
  CHECK(same_bits(db, db_full));

  SECTION("without bias gradient") {
    auto dw2 = dw0;
    linear_backward(nullptr, dw2.data(), nullptr, dout.data(), inp.data(), weight.data(), N, C, OC);
    CHECK(same_bits(dw2, dw_full));
  }
}

TEST_CASE("layernorm backward: input-only + weight-only calls equal the full call",
          "[layernorm][backward_modes]") {
  const int N = GENERATE(7, 65), C = GENERATE(8, 100);
  std::mt19937 rng(N * 3 + C);
  const auto inp = random_vec(N * C, rng, -2.0f, 2.0f);
  const auto weight = random_vec(C, rng, 0.5f, 1.5f), bias = random_vec(C, rng);
  const auto dout = random_vec(N * C, rng);
  std::vector<float> out(N * C), mean(N), rstd(N);
  layernorm_forward(out.data(), mean.data(), rstd.data(), inp.data(), weight.data(), bias.data(), N,
                    C);
  const auto dinp0 = random_vec(N * C, rng), dw0 = random_vec(C, rng), db0 = random_vec(C, rng);

  auto dinp_full = dinp0, dw_full = dw0, db_full = db0;
  layernorm_backward(dinp_full.data(), dw_full.data(), db_full.data(), dout.data(), inp.data(),
                     weight.data(), mean.data(), rstd.data(), N, C);

  auto dinp = dinp0, dw = dw0, db = db0;
  layernorm_backward(dinp.data(), nullptr, nullptr, dout.data(), inp.data(), weight.data(),
                     mean.data(), rstd.data(), N, C);
  CHECK(same_bits(dinp, dinp_full));
  CHECK(same_bits(dw, dw0));
  CHECK(same_bits(db, db0));
  layernorm_backward(nullptr, dw.data(), db.data(), dout.data(), inp.data(), weight.data(),
                     mean.data(), rstd.data(), N, C);
  CHECK(same_bits(dinp, dinp_full));
  CHECK(same_bits(dw, dw_full));
  CHECK(same_bits(db, db_full));

  SECTION("weight and bias gradients one at a time") {
    auto w_only = dw0, b_only = db0;
    layernorm_backward(nullptr, w_only.data(), nullptr, dout.data(), inp.data(), weight.data(),
                       mean.data(), rstd.data(), N, C);
    layernorm_backward(nullptr, nullptr, b_only.data(), dout.data(), inp.data(), weight.data(),
                       mean.data(), rstd.data(), N, C);
    CHECK(same_bits(w_only, dw_full));
    CHECK(same_bits(b_only, db_full));
  }
}

TEST_CASE("embedding backward: dwte-only + dwpe-only calls equal the full call",
          "[embedding][backward_modes]") {
  const int B = 2, T = 5, C = 40, Vp = 8;
  std::mt19937 rng(99);
  const std::vector<std::int32_t> tokens{3, 1, 3, 0, 6, 6, 3, 2, 5, 1};
  const auto dout = random_vec(B * T * C, rng);
  const auto dwte0 = random_vec(Vp * C, rng), dwpe0 = random_vec(T * C, rng);
  auto dwte_full = dwte0, dwpe_full = dwpe0;
  embedding_backward(dwte_full.data(), dwpe_full.data(), dout.data(), tokens.data(), B, T, C);
  auto dwte = dwte0, dwpe = dwpe0;
  embedding_backward(dwte.data(), nullptr, dout.data(), tokens.data(), B, T, C);
  CHECK(same_bits(dwte, dwte_full));
  CHECK(same_bits(dwpe, dwpe0));
  embedding_backward(nullptr, dwpe.data(), dout.data(), tokens.data(), B, T, C);
  CHECK(same_bits(dwpe, dwpe_full));
}
