// tensor.hpp basics (zeros, views, borrowing, bounds and dtype checks) and the bf16 / f16
// conversions: exact round trips of every representable value, round-to-nearest-even,
// f16 subnormals and overflow to infinity.
#include <catch2/catch.hpp>

#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <stdexcept>

#include "kernels/tensor.hpp"

using namespace troupe::kernels;

TEST_CASE("tensor zeros, views and borrowing", "[tensor]") {
  tensor t = tensor::zeros({2, 3, 4});
  CHECK(t.rank() == 3);
  CHECK(t.dim(1) == 3);
  CHECK(t.numel() == 24);
  CHECK(t.nbytes() == 96);
  CHECK(t.owns_storage());
  CHECK(t.type() == dtype::f32);
  CHECK(t.device() == device_kind::cpu);
  CHECK(reinterpret_cast<std::uintptr_t>(t.data()) % 64 == 0);
  for (std::int64_t i = 0; i < t.numel(); ++i) CHECK(t.f32()[i] == 0.0f);

  tensor v = t.view(12, {3, 4});
  CHECK(v.numel() == 12);
  CHECK(v.f32() == t.f32() + 12);
  v.f32()[0] = 5.0f;
  CHECK(t.f32()[12] == 5.0f);  // shares storage
  CHECK(v.owns_storage());
  CHECK(t.view(0, {24}).numel() == 24);
  CHECK_THROWS_AS(t.view(13, {3, 4}), std::out_of_range);
  CHECK_THROWS_AS(t.view(-1, {2}), std::out_of_range);
  CHECK_THROWS_AS(t.view(0, {25}), std::out_of_range);
  CHECK_THROWS_AS(tensor::zeros({2, -1}), std::invalid_argument);

  float buf[6] = {1, 2, 3, 4, 5, 6};
  tensor b = tensor::borrow(buf, {2, 3});
  CHECK_FALSE(b.owns_storage());
  CHECK(b.f32() == buf);
  CHECK(b.view(3, {3}).f32()[2] == 6.0f);
  b.fill_zero();
  CHECK(buf[5] == 0.0f);

  tensor h = tensor::zeros({4}, dtype::bf16);
  CHECK(h.nbytes() == 8);
  CHECK_THROWS_AS(h.f32(), std::logic_error);
  CHECK(shape_numel({}) == 1);
  CHECK(shape_string({2, 3}) == "[2, 3]");
  CHECK(dtype_size(dtype::f16) == 2);
  CHECK(dtype_name(dtype::bf16) == "bf16");
}

TEST_CASE("bf16 conversions", "[tensor][bf16]") {
  // Every non-NaN bf16 value survives a round trip through f32 exactly.
  int mismatches = 0;
  for (std::uint32_t h = 0; h < 0x10000u; ++h) {
    const float f = bf16_to_f32(static_cast<std::uint16_t>(h));
    if (std::isnan(f)) continue;
    mismatches += f32_to_bf16(f) != h;
  }
  CHECK(mismatches == 0);
  CHECK(f32_to_bf16(1.0f) == 0x3f80);
  CHECK(bf16_to_f32(0xc020) == -2.5f);
  // Round to nearest even: ties go to the even mantissa.
  CHECK(f32_to_bf16(1.0f + 0x1p-8f) == 0x3f80);             // tie -> 1.0
  CHECK(f32_to_bf16(1.0f + 3 * 0x1p-8f) == 0x3f82);         // tie -> 1 + 2^-6
  CHECK(f32_to_bf16(1.0f + 0x1p-8f + 0x1p-20f) == 0x3f81);  // above tie -> up
  CHECK(f32_to_bf16(-(1.0f + 0x1p-8f + 0x1p-20f)) == 0xbf81);
  CHECK(f32_to_bf16(std::numeric_limits<float>::infinity()) == 0x7f80);
  CHECK(std::isnan(bf16_to_f32(f32_to_bf16(std::numeric_limits<float>::quiet_NaN()))));
}

TEST_CASE("f16 conversions", "[tensor][f16]") {
  int mismatches = 0;
  for (std::uint32_t h = 0; h < 0x10000u; ++h) {
    const float f = f16_to_f32(static_cast<std::uint16_t>(h));
    if (std::isnan(f)) continue;
    mismatches += f32_to_f16(f) != h;
  }
  CHECK(mismatches == 0);
  CHECK(f32_to_f16(1.0f) == 0x3c00);
  CHECK(f16_to_f32(0xc100) == -2.5f);
  // Round to nearest even.
  CHECK(f32_to_f16(1.0f + 0x1p-11f) == 0x3c00);      // tie -> 1.0
  CHECK(f32_to_f16(1.0f + 3 * 0x1p-11f) == 0x3c02);  // tie -> even
  CHECK(f32_to_f16(2049.0f) == f32_to_f16(2048.0f));
  CHECK(f16_to_f32(f32_to_f16(2051.0f)) == 2052.0f);
  // Subnormals: 2^-24 is the smallest.
  CHECK(f16_to_f32(0x0001) == 0x1p-24f);
  CHECK(f16_to_f32(0x03ff) == 1023 * 0x1p-24f);
  CHECK(f32_to_f16(0x1p-24f) == 0x0001);
  CHECK(f32_to_f16(0x1p-25f) == 0x0000);          // tie -> 0 (even)
  CHECK(f32_to_f16(0x1p-25f * 1.01f) == 0x0001);  // above the tie
  CHECK(f32_to_f16(1.5f * 0x1p-24f) == 0x0002);   // tie -> even
  CHECK(f32_to_f16(2.5f * 0x1p-24f) == 0x0002);   // tie -> even
  CHECK(f32_to_f16(3.5f * 0x1p-24f) == 0x0004);
  CHECK(f32_to_f16(-0x1p-24f) == 0x8001);
  CHECK(f32_to_f16(0x1p-14f) == 0x0400);  // smallest normal
  CHECK(f32_to_f16(0x1p-30f) == 0x0000);
  // Overflow: 65504 is the largest finite; from the 65520 tie on it rounds to infinity.
  CHECK(f32_to_f16(65504.0f) == 0x7bff);
  CHECK(f32_to_f16(65519.0f) == 0x7bff);
  CHECK(f32_to_f16(65520.0f) == 0x7c00);
  CHECK(f32_to_f16(1e6f) == 0x7c00);
  CHECK(f32_to_f16(-1e6f) == 0xfc00);
  CHECK(f32_to_f16(std::numeric_limits<float>::infinity()) == 0x7c00);
  CHECK(std::isinf(f16_to_f32(0x7c00)));
  CHECK(std::isnan(f16_to_f32(f32_to_f16(std::numeric_limits<float>::quiet_NaN()))));
}
