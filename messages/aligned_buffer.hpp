// A receive buffer for one wire frame: 64-byte aligned (Cap'n Proto needs 8; tensors like 64),
// shared so that decoded payloads can point into it (payload.hpp views) without a copy.
// make_large() is for long-lived buffers of megabytes (the transport's receive pool): 2 MiB
// aligned and advised to use transparent huge pages (madvise(MADV_HUGEPAGE); a hint the kernel
// may ignore), so a frame touches 512 times fewer pages when UCX writes it.
#pragma once

#include <sys/mman.h>

#include <cstddef>
#include <memory>
#include <new>

namespace troupe::messages {

class aligned_buffer {
 public:
  static constexpr std::size_t alignment = 64;
  static constexpr std::size_t huge_page = std::size_t{2} << 20;
  static std::shared_ptr<aligned_buffer> make(std::size_t bytes) {
    return std::shared_ptr<aligned_buffer>(new aligned_buffer(bytes, alignment));
  }
  static std::shared_ptr<aligned_buffer> make_large(std::size_t bytes) {
    if (bytes < huge_page) return make(bytes);
    auto buffer = std::shared_ptr<aligned_buffer>(
        new aligned_buffer((bytes + huge_page - 1) / huge_page * huge_page, huge_page));
    ::madvise(buffer->data_, buffer->size_, MADV_HUGEPAGE);
    return buffer;
  }
  ~aligned_buffer() { ::operator delete (data_, std::align_val_t{alignment_}); }
  aligned_buffer(const aligned_buffer&) = delete;
  aligned_buffer& operator=(const aligned_buffer&) = delete;

  std::byte* data() { return data_; }
  const std::byte* data() const { return data_; }
  std::size_t size() const { return size_; }

 private:
  aligned_buffer(std::size_t bytes, std::size_t align)
      : data_(static_cast<std::byte*>(
            ::operator new (bytes == 0 ? align : bytes, std::align_val_t{align}))),
        size_(bytes),
        alignment_(align) {}
  std::byte* data_;
  std::size_t size_;
  std::size_t alignment_;
};

}  // namespace troupe::messages
