// Receive buffers for whole wire frames, reused once every holder dropped them (the UCX
// transport's receive side): a fresh 16 MiB buffer per frame faulted in ~3,000 pages per frame on
// the development machine, which cost about as much as moving the frame; and a fresh buffer for an
// 8-byte frame (three allocations) cost 142 ns a frame against 28 for taking and giving back a
// pooled one, on a round trip of about 0.6 us. No UCX, no CAF.
#pragma once

#include <algorithm>
#include <bit>
#include <cstddef>
#include <map>
#include <memory>
#include <mutex>
#include <vector>

#include "messages/aligned_buffer.hpp"

namespace troupe::topology {

// Receive buffers by size class: powers of two from 64 bytes up to 4 KiB, then a granule of 1/16
// of the size's power of two, at least 4 KiB. take() hands out a buffer that no one else holds;
// it returns to the pool when its last holder drops it (on any thread), unless pool_idle_bytes
// are idle already.
class buffer_pool : public std::enable_shared_from_this<buffer_pool> {
 public:
  static constexpr std::size_t pool_idle_bytes = std::size_t{512} << 20;

  // The size of the buffer take(bytes) hands out.
  static constexpr std::size_t size_class(std::size_t bytes) {
    if (bytes <= 4096) return std::bit_ceil(std::max<std::size_t>(bytes, 64));
    const std::size_t granule = std::max<std::size_t>(4096, std::bit_floor(bytes) / 16);
    return (bytes + granule - 1) / granule * granule;
  }

  std::shared_ptr<messages::aligned_buffer> take(std::size_t bytes) {
    const std::size_t size = size_class(bytes);
    std::shared_ptr<messages::aligned_buffer> buffer;
    {
      std::lock_guard lock(mutex_);
      // The buffer released last (warmest in cache) first.
      if (auto it = idle_.find(size); it != idle_.end() && !it->second.empty()) {
        buffer = std::move(it->second.back());
        it->second.pop_back();
        idle_bytes_ -= size;
      }
    }
    if (!buffer) buffer = messages::aligned_buffer::make_large(size);
    messages::aligned_buffer* raw = buffer.get();
    // The buffer moves into the deleter (a copy would cost two atomic reference-count updates,
    // on a path that runs once per received frame).
    std::shared_ptr<void> lease(
        nullptr, [pool = shared_from_this(), size, buffer = std::move(buffer)](void*) mutable {
          pool->give_back(size, std::move(buffer));
        });
    return std::shared_ptr<messages::aligned_buffer>(std::move(lease), raw);
  }

  std::size_t idle_bytes() {
    std::lock_guard lock(mutex_);
    return idle_bytes_;
  }

 private:
  // size: the size class the buffer was taken for (make_large may have rounded it up).
  void give_back(std::size_t size, std::shared_ptr<messages::aligned_buffer> buffer) {
    std::lock_guard lock(mutex_);
    if (idle_bytes_ + size > pool_idle_bytes) return;
    idle_bytes_ += size;
    idle_[size].push_back(std::move(buffer));
  }
  std::mutex mutex_;
  // Idle buffers by size class, the last released at the back: once warm, taking and giving back
  // a buffer allocates nothing.
  std::map<std::size_t, std::vector<std::shared_ptr<messages::aligned_buffer>>> idle_;
  std::size_t idle_bytes_ = 0;
};

}  // namespace troupe::topology
