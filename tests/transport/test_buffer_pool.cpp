// transport::buffer_pool: size classes, reuse only after the last holder dropped a buffer, the
// buffer released last handed out first, and the cap on idle bytes. No UCX.
#include <catch2/catch.hpp>

#include <cstdint>
#include <memory>
#include <set>
#include <thread>
#include <vector>

#include "transport/buffer_pool.hpp"

using troupe::transport::buffer_pool;

TEST_CASE("buffer_pool size classes hold the frame, 64-byte aligned", "[unit]") {
  CHECK(buffer_pool::size_class(0) == 64);
  CHECK(buffer_pool::size_class(8) == 64);
  CHECK(buffer_pool::size_class(65) == 128);
  CHECK(buffer_pool::size_class(4096) == 4096);
  CHECK(buffer_pool::size_class(4097) == 8192);
  CHECK(buffer_pool::size_class(65536 + 192) == 69632);  // a 64 KiB activation frame
  CHECK(buffer_pool::size_class(std::size_t{1} << 20) == std::size_t{1} << 20);
  auto pool = std::make_shared<buffer_pool>();
  for (std::size_t bytes : {std::size_t{0}, std::size_t{8}, std::size_t{100}, std::size_t{5000},
                            std::size_t{70000}, std::size_t{3} << 20}) {
    CAPTURE(bytes);
    const auto b = pool->take(bytes);
    CHECK(b->size() >= bytes);
    CHECK(b->size() >= buffer_pool::size_class(bytes));
    CHECK(reinterpret_cast<std::uintptr_t>(b->data()) % 64 == 0);
  }
}

TEST_CASE("buffer_pool hands a buffer out again only after its last holder dropped it", "[unit]") {
  auto pool = std::make_shared<buffer_pool>();
  for (std::size_t bytes : {std::size_t{8}, std::size_t{70000}}) {
    CAPTURE(bytes);
    auto first = pool->take(bytes);
    auto copy = first;  // a second holder, as a decoded payload view is
    const void* address = first->data();
    first.reset();
    const auto while_held = pool->take(bytes);
    CHECK(while_held->data() != address);  // still held by `copy`
    copy.reset();
    const auto again = pool->take(bytes);
    CHECK(again->data() == address);  // released last, handed out first
  }
}

TEST_CASE("buffer_pool reuses one buffer for a receiver that drops each frame", "[unit]") {
  auto pool = std::make_shared<buffer_pool>();
  std::set<const void*> seen;
  for (int i = 0; i < 100; ++i) seen.insert(pool->take(8)->data());
  CHECK(seen.size() == 1);
}

TEST_CASE("buffer_pool takes back buffers dropped on another thread", "[unit]") {
  auto pool = std::make_shared<buffer_pool>();
  auto b = pool->take(256);
  const void* address = b->data();
  std::thread([held = std::move(b)]() mutable { held.reset(); }).join();
  CHECK(pool->take(256)->data() == address);
}

TEST_CASE("buffer_pool keeps at most pool_idle_bytes idle", "[unit]") {
  auto pool = std::make_shared<buffer_pool>();
  const std::size_t size = std::size_t{64} << 20;  // never written: the pages stay unmapped
  const std::size_t fit = buffer_pool::pool_idle_bytes / size;
  std::vector<std::shared_ptr<troupe::messages::aligned_buffer>> held;
  for (std::size_t i = 0; i < fit + 2; ++i) held.push_back(pool->take(size));
  CHECK(pool->idle_bytes() == 0);
  held.pop_back();
  CHECK(pool->idle_bytes() == size);
  held.clear();  // all idle until the next take() frees what is over the bound
  CHECK(pool->idle_bytes() == (fit + 2) * size);
  auto again = pool->take(size);
  CHECK(pool->idle_bytes() == fit * size);
  CHECK(again.use_count() == 2);  // the holder's and the pool's: not freed by the trim
  again.reset();
  CHECK(pool->idle_bytes() == (fit + 1) * size);
  pool->take(64).reset();  // any take trims again
  CHECK(pool->idle_bytes() == fit * size + 64);
}

TEST_CASE("buffer_pool buffers outlive the pool", "[unit]") {
  auto pool = std::make_shared<buffer_pool>();
  auto b = pool->take(100);
  b->data()[99] = std::byte{7};
  pool.reset();
  CHECK(b->data()[99] == std::byte{7});
}

TEST_CASE("buffer_pool hands out the buffer handed out last among the idle ones", "[unit]") {
  buffer_pool pool;
  auto a = pool.take(5000), b = pool.take(5000), c = pool.take(5000);
  const void* second = b->data();
  a.reset();
  b.reset();  // a and b idle; b was handed out after a
  CHECK(pool.take(5000)->data() == second);
}
