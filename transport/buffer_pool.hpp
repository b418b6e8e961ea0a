// Receive buffers for whole wire frames, reused once every holder dropped them (the UCX
// transport's receive side): a fresh 16 MiB buffer per frame faulted in ~3,000 pages per frame on
// the development machine, which cost about as much as moving the frame; and a fresh buffer for an
// 8-byte frame (three allocations) cost 142 ns a frame against 28 for taking and giving back a
// pooled one, on a round trip of about 0.6 us. No UCX, no CAF.
//
// The pool keeps one reference to every buffer it made; a buffer is idle when that is the only
// one left (use_count() == 1). So handing a buffer out is a shared_ptr copy and dropping it is the
// holder's own reference-count decrement, on any thread: no lock, no lease, no allocation (a
// deleter that gave buffers back would allocate a control block per frame and lock the pool).
#pragma once

#include <algorithm>
#include <atomic>
#include <bit>
#include <cstddef>
#include <memory>
#include <utility>
#include <vector>

#include "messages/aligned_buffer.hpp"

namespace troupe::transport {

// Receive buffers by size class: powers of two from 64 bytes up to 4 KiB, then a granule of 1/16
// of the size's power of two, at least 4 KiB. take() hands out a buffer that no one else holds.
// take() and idle_bytes() belong to one thread (the transport's progress thread); the buffers
// handed out may be dropped on any thread. Idle buffers beyond pool_idle_bytes are freed by the
// next take() (the oldest first), so the pool holds more only between a burst and the next frame.
class buffer_pool {
 public:
  static constexpr std::size_t pool_idle_bytes = std::size_t{512} << 20;

  // The size of the buffer take(bytes) hands out.
  static constexpr std::size_t size_class(std::size_t bytes) {
    if (bytes <= 4096) return std::bit_ceil(std::max<std::size_t>(bytes, 64));
    const std::size_t granule = std::max<std::size_t>(4096, std::bit_floor(bytes) / 16);
    return (bytes + granule - 1) / granule * granule;
  }

  // The common case inline (a receiver that drops each frame: the class used last, its buffer
  // handed out last is idle again): a few compares and the holder's reference.
  std::shared_ptr<messages::aligned_buffer> take(std::size_t bytes) {
    if (last_ < classes_.size() && held_bytes_ <= pool_idle_bytes) {
      const auto& c = classes_[last_];
      if (c.size == size_class(bytes) && !c.buffers.empty() && idle(c.buffers.back()))
        return c.buffers.back();
    }
    return take_slow(bytes);
  }

  // Bytes in buffers no one but the pool holds.
  std::size_t idle_bytes() const {
    std::size_t bytes = 0;
    for (const auto& c : classes_)
      for (const auto& b : c.buffers)
        if (b.use_count() == 1) bytes += c.size;
    return bytes;
  }

 private:
  struct size_class_list {
    std::size_t size = 0;
    std::vector<std::shared_ptr<messages::aligned_buffer>> buffers;  // last handed out at the back
  };

  // use_count() is a relaxed load; the acquire fence orders it after the last holder's release
  // (its decrement is acq_rel), so that holder's reads and writes happen before we reuse the bytes.
  static bool idle(const std::shared_ptr<messages::aligned_buffer>& b) {
    if (b.use_count() != 1) return false;
    std::atomic_thread_fence(std::memory_order_acquire);
    return true;
  }

  // The holder's copy first, so that trim() sees the buffer as held.
  std::shared_ptr<messages::aligned_buffer> handed_out(
      const std::shared_ptr<messages::aligned_buffer>& b) {
    auto copy = b;
    if (held_bytes_ > pool_idle_bytes) trim();
    return copy;
  }

  [[gnu::noinline]] std::shared_ptr<messages::aligned_buffer> take_slow(std::size_t bytes) {
    const std::size_t size = size_class(bytes);
    auto& list = class_of(size).buffers;
    // Kept in the order they were last handed out, the latest at the back: the first idle one
    // from the back is the one handed out last among the idle, which for frames consumed in
    // order is the one released last (warmest in cache).
    for (std::size_t i = list.size(); i-- > 0;) {
      if (!idle(list[i])) continue;
      if (i + 1 != list.size())
        std::rotate(list.begin() + static_cast<std::ptrdiff_t>(i),
                    list.begin() + static_cast<std::ptrdiff_t>(i) + 1, list.end());
      return handed_out(list.back());
    }
    list.push_back(messages::aligned_buffer::make_large(size));
    held_bytes_ += size;
    return handed_out(list.back());
  }

  size_class_list& class_of(std::size_t size) {
    if (last_ < classes_.size() && classes_[last_].size == size) return classes_[last_];
    for (last_ = 0; last_ < classes_.size(); ++last_)
      if (classes_[last_].size == size) return classes_[last_];
    classes_.push_back({size, {}});
    return classes_.back();
  }

  // Frees idle buffers, the least recently handed out of each class first, until at most
  // pool_idle_bytes are idle.
  void trim() {
    std::size_t idle_now = idle_bytes();
    for (auto& c : classes_) {
      if (idle_now <= pool_idle_bytes) break;
      std::erase_if(c.buffers, [&](const std::shared_ptr<messages::aligned_buffer>& b) {
        if (idle_now <= pool_idle_bytes || !idle(b)) return false;
        idle_now -= c.size;
        held_bytes_ -= c.size;
        return true;
      });
    }
  }

  std::vector<size_class_list> classes_;
  std::size_t last_ = 0;        // the class take() used last
  std::size_t held_bytes_ = 0;  // in every buffer the pool made and still holds, idle or not
};

}  // namespace troupe::transport
