// messages::payload_memory: blocks are page aligned, long enough and at most 1/8 longer than
// asked, never handed out twice at once, reused once released, 2 MiB aligned from 2 MiB, in
// mappings advised to use huge pages; the usage figures add up; payloads of 16 KiB and more
// take their storage from it; many threads at once neither share nor lose a block.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <map>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "messages/payload.hpp"
#include "messages/payload_memory.hpp"

namespace pm = troupe::messages::payload_memory;

namespace {

std::uintptr_t address(const void* p) { return reinterpret_cast<std::uintptr_t>(p); }

// The smaps field `field` ("THPeligible") of the mapping holding `p`; -1 if not found.
long long smaps_field(const void* p, const std::string& field) {
  std::ifstream smaps("/proc/self/smaps");
  bool inside = false;
  const std::string format = field + ": %lld";
  for (std::string line; std::getline(smaps, line);) {
    unsigned long long low = 0, high = 0;
    if (std::sscanf(line.c_str(), "%llx-%llx ", &low, &high) == 2) {
      inside = address(p) >= low && address(p) < high;
      continue;
    }
    long long value = 0;
    if (inside && std::sscanf(line.c_str(), format.c_str(), &value) == 1) return value;
  }
  return -1;
}

// The bracketed word of /sys/kernel/mm/transparent_hugepage/enabled ("madvise"), or "".
std::string thp_mode() {
  std::ifstream f("/sys/kernel/mm/transparent_hugepage/enabled");
  std::string text((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  const auto open = text.find('['), close = text.find(']');
  return open == std::string::npos || close < open ? "" : text.substr(open + 1, close - open - 1);
}

}  // namespace

TEST_CASE("a payload block is page aligned and at most 1/8 longer than asked", "[unit]") {
  for (std::size_t bytes :
       {pm::min_bytes, pm::min_bytes + 1, std::size_t{65536}, std::size_t{65536} + 4,
        std::size_t{100000}, std::size_t{1} << 20, (std::size_t{2} << 20) - 4, std::size_t{2} << 20,
        (std::size_t{3} << 20) + 12, std::size_t{16} << 20}) {
    CAPTURE(bytes);
    const std::size_t length = pm::block_bytes(bytes);
    CHECK(length >= bytes);
    CHECK(length % 4096 == 0);
    CHECK(length <= std::max(bytes + bytes / 8, (bytes + 4095) / 4096 * 4096));
    void* block = pm::allocate(bytes);
    CHECK(address(block) % 4096 == 0);
    if (length >= pm::huge_page_bytes) CHECK(address(block) % pm::huge_page_bytes == 0);
    auto* bytes_at = static_cast<unsigned char*>(block);
    bytes_at[0] = 1;  // the whole block is writable
    bytes_at[length - 1] = 2;
    pm::release(block, bytes);
  }
}

TEST_CASE("payload blocks in use never overlap, and a released block is reused", "[unit]") {
  std::vector<std::pair<void*, std::size_t>> held;
  for (int i = 0; i < 40; ++i) {
    const std::size_t bytes = pm::min_bytes + static_cast<std::size_t>(i) * 12345;
    held.emplace_back(pm::allocate(bytes), bytes);
  }
  held.emplace_back(pm::allocate(std::size_t{5} << 20), std::size_t{5} << 20);
  auto sorted = held;
  std::sort(sorted.begin(), sorted.end());
  for (std::size_t i = 1; i < sorted.size(); ++i)
    CHECK(address(sorted[i - 1].first) + pm::block_bytes(sorted[i - 1].second) <=
          address(sorted[i].first));
  for (auto [block, bytes] : held) pm::release(block, bytes);
  // The last released block of a length comes back for the next request of that length.
  void* again = pm::allocate(held.back().second);
  CHECK(again == held.back().first);
  pm::release(again, held.back().second);
  void* small = pm::allocate(held.front().second);
  CHECK(small == held.front().first);
  pm::release(small, held.front().second);
}

TEST_CASE("payload memory's usage adds up", "[unit]") {
  const auto before = pm::current_usage();
  const std::size_t bytes = 777777;  // a length no other case here uses
  void* block = pm::allocate(bytes);
  const auto holding = pm::current_usage();
  CHECK(holding.in_use_bytes == before.in_use_bytes + pm::block_bytes(bytes));
  CHECK(holding.mapped_bytes >= holding.in_use_bytes + holding.kept_bytes);
  pm::release(block, bytes);
  const auto after = pm::current_usage();
  CHECK(after.in_use_bytes == before.in_use_bytes);
  CHECK(after.kept_bytes == holding.kept_bytes + pm::block_bytes(bytes));
  // Reused, so nothing new is mapped for it.
  void* again = pm::allocate(bytes);
  CHECK(pm::current_usage().mapped_bytes == after.mapped_bytes);
  pm::release(again, bytes);
}

TEST_CASE("payload memory is advised to use transparent huge pages", "[unit]") {
  const std::string mode = thp_mode();
  if (mode.empty() || mode == "never") {
    WARN("transparent huge pages are '" << mode << "' here: the advice cannot be seen");
    return;
  }
  // THPeligible: the kernel would back the mapping with huge pages (madvise'd, or "always").
  for (std::size_t bytes : {std::size_t{65536}, std::size_t{6} << 20}) {
    CAPTURE(bytes, mode);
    void* block = pm::allocate(bytes);
    CHECK(smaps_field(block, "THPeligible") == 1);
    pm::release(block, bytes);
  }
}

TEST_CASE("a payload of 16 KiB or more takes its storage from payload memory", "[unit]") {
  const std::size_t n = 50000;  // 200000 bytes
  const auto before = pm::current_usage().in_use_bytes;
  {
    const troupe::messages::payload<float> p(n);
    CHECK(pm::current_usage().in_use_bytes == before + pm::block_bytes(n * sizeof(float)));
    std::vector<float> source(n, 3.0f);
    const troupe::messages::payload<float> copy(source.data(), source.data() + n);
    CHECK(pm::current_usage().in_use_bytes == before + 2 * pm::block_bytes(n * sizeof(float)));
    CHECK(copy[n - 1] == 3.0f);
  }
  CHECK(pm::current_usage().in_use_bytes == before);
  const troupe::messages::payload<float> small(std::size_t{1000});  // 4000 bytes: operator new
  CHECK(pm::current_usage().in_use_bytes == before);
}

TEST_CASE("threads allocating and releasing at once never share a block", "[unit][threads]") {
  constexpr int threads = 4, rounds = 3000;
  std::vector<std::thread> workers;
  std::vector<int> corrupted(threads, 0);
  const auto before = pm::current_usage().in_use_bytes;
  for (int t = 0; t < threads; ++t) {
    workers.emplace_back([t, &corrupted] {
      std::mt19937 rng(static_cast<unsigned>(t) + 1);
      std::uniform_int_distribution<std::size_t> size(pm::min_bytes, std::size_t{300} << 10);
      struct held {
        std::uint32_t* block;
        std::size_t bytes;
        std::uint32_t mark;
      };
      std::vector<held> mine;
      auto release_oldest = [&] {
        const held h = mine.front();
        mine.erase(mine.begin());
        const std::size_t n = h.bytes / 4;
        if (h.block[0] != h.mark || h.block[n / 2] != h.mark || h.block[n - 1] != h.mark)
          ++corrupted[t];
        pm::release(h.block, h.bytes);
      };
      for (int r = 0; r < rounds; ++r) {
        const std::size_t bytes = size(rng) / 4 * 4;
        auto* block = static_cast<std::uint32_t*>(pm::allocate(bytes));
        const std::uint32_t mark = static_cast<std::uint32_t>(t) << 24 | static_cast<unsigned>(r);
        std::fill(block, block + bytes / 4, mark);
        mine.push_back({block, bytes, mark});
        if (mine.size() > 8) release_oldest();
      }
      while (!mine.empty()) release_oldest();
    });
  }
  for (auto& w : workers) w.join();
  for (int t = 0; t < threads; ++t) CHECK(corrupted[t] == 0);
  CHECK(pm::current_usage().in_use_bytes == before);
}
