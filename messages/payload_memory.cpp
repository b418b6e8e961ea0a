// Payload storage in huge-page-advised mappings, kept for reuse (payload_memory.hpp).
#include "messages/payload_memory.hpp"

#include <sys/mman.h>

#include <algorithm>
#include <bit>
#include <cstdint>
#include <mutex>
#include <new>
#include <unordered_map>
#include <vector>

#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/asan_interface.h>
#define TROUPE_POISON(p, n) ASAN_POISON_MEMORY_REGION(p, n)
#define TROUPE_UNPOISON(p, n) ASAN_UNPOISON_MEMORY_REGION(p, n)
#else
#define TROUPE_POISON(p, n) ((void)(p), (void)(n))
#define TROUPE_UNPOISON(p, n) ((void)(p), (void)(n))
#endif

namespace troupe::messages::payload_memory {
namespace {

constexpr std::size_t page_bytes = 4096;
// Blocks under 2 MiB are carved one after the other from slabs of four huge pages.
constexpr std::size_t slab_bytes = 4 * huge_page_bytes;

// `bytes` (a multiple of 4 KiB) mapped 2 MiB aligned and advised to use huge pages.
void* map_aligned(std::size_t bytes) {
  const std::size_t reserved = bytes + huge_page_bytes;
  void* m = ::mmap(nullptr, reserved, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (m == MAP_FAILED) throw std::bad_alloc();
  const auto base = reinterpret_cast<std::uintptr_t>(m);
  const std::uintptr_t at = (base + huge_page_bytes - 1) / huge_page_bytes * huge_page_bytes;
  if (at > base) ::munmap(m, at - base);
  if (const std::size_t tail = base + reserved - (at + bytes); tail > 0)
    ::munmap(reinterpret_cast<void*>(at + bytes), tail);
  ::madvise(reinterpret_cast<void*>(at), bytes, MADV_HUGEPAGE);  // a hint; may be ignored
  return reinterpret_cast<void*>(at);
}

struct state {
  std::mutex mutex;
  std::unordered_map<std::size_t, std::vector<void*>> kept;  // block length -> released blocks
  std::byte* slab_next = nullptr;  // the current slab's first uncarved byte
  std::size_t slab_left = 0;
  std::size_t kept_large_bytes = 0;
  usage totals;
};

// Never destroyed: payloads may be released while static objects are torn down.
state& the_state() {
  static state* s = new state;
  return *s;
}

}  // namespace

std::size_t block_bytes(std::size_t bytes) {
  const std::size_t granule = std::max(page_bytes, std::bit_floor(std::max(bytes, page_bytes)) / 8);
  return (bytes + granule - 1) / granule * granule;
}

void* allocate(std::size_t bytes) {
  const std::size_t length = block_bytes(std::max(bytes, min_bytes));
  state& s = the_state();
  void* block = nullptr;
  {
    const std::lock_guard lock(s.mutex);
    auto& list = s.kept[length];
    if (!list.empty()) {
      block = list.back();
      list.pop_back();
      s.totals.kept_bytes -= length;
      if (length >= huge_page_bytes) s.kept_large_bytes -= length;
    } else if (length >= huge_page_bytes) {
      block = map_aligned(length);
      s.totals.mapped_bytes += length;
    } else {
      if (s.slab_left < length) {  // the rest of the current slab stays unused
        s.slab_next = static_cast<std::byte*>(map_aligned(slab_bytes));
        s.slab_left = slab_bytes;
        s.totals.mapped_bytes += slab_bytes;
      }
      block = s.slab_next;
      s.slab_next += length;
      s.slab_left -= length;
    }
    s.totals.in_use_bytes += length;
  }
  TROUPE_UNPOISON(block, length);
  return block;
}

void release(void* block, std::size_t bytes) noexcept {
  if (block == nullptr) return;
  const std::size_t length = block_bytes(std::max(bytes, min_bytes));
  TROUPE_POISON(block, length);
  state& s = the_state();
  {
    const std::lock_guard lock(s.mutex);
    s.totals.in_use_bytes -= length;
    const bool large = length >= huge_page_bytes;
    if (!large || s.kept_large_bytes + length <= max_cached_large_bytes) {
      try {
        s.kept[length].push_back(block);
        s.totals.kept_bytes += length;
        if (large) s.kept_large_bytes += length;
        return;
      } catch (const std::bad_alloc&) {  // no room to remember it: a large one is unmapped
        if (!large) return;              // a carved one stays mapped, unused
      }
    }
    s.totals.mapped_bytes -= length;
  }
  TROUPE_UNPOISON(block, length);
  ::munmap(block, length);
}

usage current_usage() {
  state& s = the_state();
  const std::lock_guard lock(s.mutex);
  return s.totals;
}

}  // namespace troupe::messages::payload_memory
