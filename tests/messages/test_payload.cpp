// messages::payload: the storage it allocates is aligned (page aligned from 16 KiB, for the
// zero-copy sends of the UCX transport), zero-filled or copied exactly; a moved-in vector keeps
// its storage; a view keeps its owner alive.
#include <catch2/catch.hpp>

#include <cstdint>
#include <memory>
#include <numeric>
#include <vector>

#include "messages/payload.hpp"

using troupe::messages::payload;

namespace {
std::uintptr_t address(const void* p) { return reinterpret_cast<std::uintptr_t>(p); }
}  // namespace

TEST_CASE("a payload's own storage is 64-byte aligned, and page aligned from 16 KiB", "[unit]") {
  for (std::size_t n : {std::size_t{0}, std::size_t{1}, std::size_t{7}, std::size_t{4095},
                        std::size_t{4096}, std::size_t{16384}, std::size_t{100000}}) {
    CAPTURE(n);
    const std::size_t expected = n * sizeof(float) >= (16 << 10) ? 4096 : 64;
    CHECK(payload<float>::alignment_for(n) == expected);
    // Several at once, so that a lucky malloc address cannot pass the check.
    std::vector<std::unique_ptr<payload<float>>> sized, copied;
    std::vector<float> source(n);
    std::iota(source.begin(), source.end(), 1.0f);
    for (int i = 0; i < 8; ++i) {
      sized.push_back(std::make_unique<payload<float>>(n));
      copied.push_back(
          std::make_unique<payload<float>>(source.data(), source.data() + source.size()));
    }
    for (int i = 0; i < 8; ++i) {
      CHECK(address(sized[i]->data()) % expected == 0);
      CHECK(address(copied[i]->data()) % expected == 0);
      REQUIRE(sized[i]->size() == n);
      REQUIRE(copied[i]->size() == n);
      for (std::size_t k = 0; k < n; ++k) {
        if ((*sized[i])[k] != 0.0f || (*copied[i])[k] != source[k]) {
          FAIL("element " << k << " of payload " << i << " is wrong");
        }
      }
    }
  }
  const payload<std::int32_t> ints(std::size_t{5000});
  CHECK(address(ints.data()) % 4096 == 0);
}

TEST_CASE("a payload built from a vector takes the vector's storage", "[unit]") {
  std::vector<float> v(1000, 2.5f);
  const float* storage = v.data();
  const payload<float> p(std::move(v));
  CHECK(p.data() == storage);
  CHECK(p.size() == 1000);
  CHECK_FALSE(p.is_view());
}

TEST_CASE("a payload view keeps its owner alive", "[unit]") {
  auto owner = std::make_shared<std::vector<float>>(16, 1.0f);
  std::weak_ptr<std::vector<float>> watch = owner;
  auto view = std::make_unique<payload<float>>(owner, owner->data() + 4, 8);
  owner.reset();
  CHECK_FALSE(watch.expired());
  CHECK(view->is_view());
  CHECK(view->size() == 8);
  CHECK((*view)[0] == 1.0f);
  view.reset();
  CHECK(watch.expired());
}
