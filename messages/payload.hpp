// A tensor payload shared between actors without copies: either storage of its own, or a view
// into memory someone else owns (a transport's aligned receive buffer), kept alive by `owner`.
// Messages hold it by std::shared_ptr, so an in-process send moves a pointer and a remote
// receive hands the stage the bytes where the transport put them.
// Storage the payload allocates itself (the sized and the copying constructors) is 64-byte
// aligned, and from 16 KiB (the size UCX sends by zero-copy rendezvous) a block of
// payload_memory: page aligned, in mappings advised to use huge pages, reused once released. A
// page-aligned 64 KiB tensor spans 16 pages instead of 17 (process_vm_readv of 64 KiB between
// two pinned processes: about 10.5 GB/s from a page-aligned source against 9.7 from malloc's
// 16-byte alignment), and in a huge page a peer's shared-memory fetch (cma) pins one page
// instead of 16 (docs/transport.md).
#pragma once

#include <cstddef>
#include <memory>
#include <new>
#include <type_traits>
#include <utility>
#include <vector>

#include "messages/payload_memory.hpp"

namespace troupe::messages {

template <class T>
class payload {
  static_assert(std::is_trivially_copyable_v<T> && std::is_trivially_destructible_v<T>,
                "a payload holds plain numbers");

 public:
  using value_type = T;
  static constexpr std::size_t page_aligned_from = payload_memory::min_bytes;
  // n zero-initialized elements in aligned storage.
  explicit payload(std::size_t n) : allocated_(allocate(n)), data_(allocated_.get()), size_(n) {
    std::uninitialized_value_construct_n(data_, n);
  }
  // n elements in aligned storage, left unwritten: the caller writes every one.
  struct for_overwrite_t {};
  static constexpr for_overwrite_t for_overwrite{};
  payload(std::size_t n, for_overwrite_t)
      : allocated_(allocate(n)), data_(allocated_.get()), size_(n) {}
  // Takes the vector's storage as it is (malloc's alignment).
  explicit payload(std::vector<T>&& v)
      : storage_(std::move(v)), data_(storage_.data()), size_(storage_.size()) {}
  // A copy of [first, last) in aligned storage.
  payload(const T* first, const T* last)
      : allocated_(allocate(static_cast<std::size_t>(last - first))),
        data_(allocated_.get()),
        size_(static_cast<std::size_t>(last - first)) {
    std::uninitialized_copy(first, last, data_);
  }
  // A view of n elements at data, valid while owner lives.
  payload(std::shared_ptr<void> owner, T* data, std::size_t n)
      : owner_(std::move(owner)), data_(data), size_(n) {}
  payload(const payload&) = delete;
  payload& operator=(const payload&) = delete;

  T* data() { return data_; }
  const T* data() const { return data_; }
  std::size_t size() const { return size_; }
  T* begin() { return data_; }
  T* end() { return data_ + size_; }
  const T* begin() const { return data_; }
  const T* end() const { return data_ + size_; }
  T& operator[](std::size_t i) { return data_[i]; }
  const T& operator[](std::size_t i) const { return data_[i]; }
  bool is_view() const { return owner_ != nullptr; }
  // The alignment of storage the payload allocates for n elements.
  static constexpr std::size_t alignment_for(std::size_t n) {
    return n * sizeof(T) >= page_aligned_from ? 4096 : 64;
  }

 private:
  // Gives storage back where allocate() took it: payload_memory from page_aligned_from bytes.
  struct storage_delete {
    std::size_t bytes = 0;
    void operator()(T* p) const {
      if (bytes >= page_aligned_from)
        payload_memory::release(p, bytes);
      else
        ::operator delete (p, std::align_val_t{64});
    }
  };
  static std::unique_ptr<T[], storage_delete> allocate(std::size_t n) {
    const std::size_t bytes = n * sizeof(T);
    void* p = bytes >= page_aligned_from
                  ? payload_memory::allocate(bytes)
                  : ::operator new (n == 0 ? 64 : bytes, std::align_val_t{64});
    return std::unique_ptr<T[], storage_delete>(static_cast<T*>(p), storage_delete{bytes});
  }

  std::unique_ptr<T[], storage_delete> allocated_;
  std::vector<T> storage_;
  std::shared_ptr<void> owner_;
  T* data_;
  std::size_t size_;
};

}  // namespace troupe::messages
