// Storage for the payloads of 16 KiB and more (payload.hpp): blocks carved from 2 MiB-aligned
// mappings advised to use transparent huge pages (madvise(MADV_HUGEPAGE)), kept for reuse when
// released, as a training job allocates the same activation and gradient sizes every step.
//
// Why huge pages: a payload sent to a process on the same host is read by that process's kernel
// (process_vm_readv, UCX's cma rendezvous), which pins every page of the sender's buffer for
// each frame. In 4 KiB pages that is 16 pins per 64 KiB frame, about half the receiver's time
// (docs/transport.md); in a huge page it is one. `troupe bench transport` at 64 KiB over shared
// memory: 5.6-6.0 GB/s from 4 KiB pages against 9.5-9.9 GB/s from huge pages (ucx_perftest
// 6.3-6.7 GB/s in the same runs).
//
// Invariants: every block is page aligned and at least as long as asked; blocks of 2 MiB and more
// are 2 MiB aligned in mappings of their own; a block is never handed out twice before it is
// released; released blocks of under 2 MiB are kept (their memory stays mapped), larger ones are
// kept while the kept large blocks stay within max_cached_large_bytes and unmapped otherwise.
// Thread-safe: blocks may be allocated and released on any thread. The kernel may ignore the
// advice (transparent huge pages "never", or no free huge page): the blocks are then 4 KiB pages
// and everything else holds. No UCX, no CAF.
#pragma once

#include <cstddef>

namespace troupe::messages::payload_memory {

inline constexpr std::size_t min_bytes = std::size_t{16} << 10;  // smaller payloads: operator new
inline constexpr std::size_t huge_page_bytes = std::size_t{2} << 20;
inline constexpr std::size_t max_cached_large_bytes = std::size_t{1} << 30;

// The length of the block allocate(bytes) hands out: a multiple of 4 KiB, at most 1/8 (and at
// least nothing) above `bytes` (rounded up to 4 KiB).
std::size_t block_bytes(std::size_t bytes);

// A page-aligned block of block_bytes(bytes), bytes >= min_bytes: a released one of that length,
// or new. Its contents are unspecified. Throws std::bad_alloc when the system has no memory.
void* allocate(std::size_t bytes);
// Takes back a block that allocate(bytes) returned, with the same `bytes`. Any thread.
void release(void* block, std::size_t bytes) noexcept;

struct usage {
  std::size_t mapped_bytes = 0;  // mapped from the system, advised to use huge pages
  std::size_t in_use_bytes = 0;  // in blocks handed out and not released
  std::size_t kept_bytes = 0;    // in released blocks kept for reuse
};
usage current_usage();

}  // namespace troupe::messages::payload_memory
