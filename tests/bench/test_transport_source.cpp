// The transport bench's send tensors (bench/transport_source.hpp): an unwritten tensor stays
// unwritten while it is read (its reads map the kernel's zero page, which smaps does not count
// as resident), its resident bytes show the first write, and it is mapped as UCX maps
// ucx_perftest's buffer; a written tensor holds its ramp in 4 KiB pages; an engine tensor is a
// payload's own storage.
#include <catch2/catch.hpp>
#include <cstdint>

#include "bench/transport_source.hpp"

namespace b = troupe::bench;

TEST_CASE("an unwritten send tensor reads as zeros and stays unresident until written") {
  for (const std::size_t bytes :
       {std::size_t{64} << 10, std::size_t{1} << 20, std::size_t{16} << 20}) {
    CAPTURE(bytes);
    const auto t = b::unwritten_tensor(bytes);
    REQUIRE(t->size() * sizeof(float) == bytes);
    REQUIRE(t->is_view());
    CHECK(b::resident_bytes(t->data()) == 0);
    // Reading every element (as the kernel does when it sends the tensor) writes nothing.
    const volatile float* p = t->data();
    float sum = 0;
    for (std::size_t i = 0; i < t->size(); ++i) sum += p[i];
    CHECK(sum == 0);
    CHECK(b::resident_bytes(t->data()) == 0);
    // One write makes a page (or a huge page) resident: the check sees a written tensor.
    (*t)[t->size() / 2] = 1;
    CHECK(b::resident_bytes(t->data()) >= 4096);
  }
}

TEST_CASE("an unwritten send tensor is mapped as UCX maps ucx_perftest's buffer") {
  // 16 MiB: UCX's "thp" method (2 MiB aligned); 64 KiB and 1 MiB: a plain page-aligned mapping.
  CHECK(reinterpret_cast<std::uintptr_t>(b::unwritten_tensor(std::size_t{16} << 20)->data()) %
            (std::size_t{2} << 20) ==
        0);
  CHECK(reinterpret_cast<std::uintptr_t>(b::unwritten_tensor(std::size_t{64} << 10)->data()) %
            4096 ==
        0);
}

TEST_CASE("a written send tensor is resident in 4 KiB pages and holds its ramp") {
  for (const std::size_t bytes : {std::size_t{64} << 10, std::size_t{16} << 20}) {
    CAPTURE(bytes);
    const auto t = b::written_tensor(bytes);
    REQUIRE(t->size() == bytes / sizeof(float));
    CHECK((*t)[0] == 0);
    CHECK((*t)[978] == 1);
    CHECK(b::resident_bytes(t->data()) >= static_cast<long long>(bytes));
    CHECK(b::huge_page_bytes(t->data()) == 0);  // advised not to: as ucx_perftest's buffer
  }
}

TEST_CASE("an engine send tensor is a payload's own storage and holds its ramp") {
  const auto t = b::engine_tensor(std::size_t{1} << 20);
  REQUIRE(t->size() == (std::size_t{1} << 20) / sizeof(float));
  CHECK_FALSE(t->is_view());
  CHECK(reinterpret_cast<std::uintptr_t>(t->data()) % 4096 == 0);
  CHECK((*t)[978] == 1);
  CHECK(b::huge_page_bytes(t->data()) >= 0);  // its mapping is found; huge pages are the kernel's
}

TEST_CASE("resident_bytes says -1 for an address no mapping holds") {
  CHECK(b::resident_bytes(reinterpret_cast<const void*>(std::uintptr_t{4096})) == -1);
  CHECK(b::huge_page_bytes(reinterpret_cast<const void*>(std::uintptr_t{4096})) == -1);
}
