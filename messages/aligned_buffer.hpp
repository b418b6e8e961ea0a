// A receive buffer for one wire frame: 64-byte aligned (Cap'n Proto needs 8; tensors like 64),
// shared so that decoded payloads can point into it (payload.hpp views) without a copy.
#pragma once

#include <cstddef>
#include <memory>
#include <new>

namespace troupe::messages {

class aligned_buffer {
 public:
  static constexpr std::size_t alignment = 64;
  static std::shared_ptr<aligned_buffer> make(std::size_t bytes) {
    return std::shared_ptr<aligned_buffer>(new aligned_buffer(bytes));
  }
  ~aligned_buffer() { ::operator delete (data_, std::align_val_t{alignment}); }
  aligned_buffer(const aligned_buffer&) = delete;
  aligned_buffer& operator=(const aligned_buffer&) = delete;

  std::byte* data() { return data_; }
  const std::byte* data() const { return data_; }
  std::size_t size() const { return size_; }

 private:
  explicit aligned_buffer(std::size_t bytes)
      : data_(static_cast<std::byte*>(
            ::operator new (bytes == 0 ? alignment : bytes, std::align_val_t{alignment}))),
        size_(bytes) {}
  std::byte* data_;
  std::size_t size_;
};

}  // namespace troupe::messages
