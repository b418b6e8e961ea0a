// A tensor payload shared between actors without copies: either storage of its own, or a view
// into memory someone else owns (a transport's aligned receive buffer), kept alive by `owner`.
// Messages hold it by std::shared_ptr, so an in-process send moves a pointer and a remote
// receive hands the stage the bytes where the transport put them.
#pragma once

#include <cstddef>
#include <memory>
#include <utility>
#include <vector>

namespace troupe::messages {

template <class T>
class payload {
 public:
  using value_type = T;
  explicit payload(std::size_t n) : storage_(n), data_(storage_.data()), size_(n) {}
  explicit payload(std::vector<T>&& v)
      : storage_(std::move(v)), data_(storage_.data()), size_(storage_.size()) {}
  payload(const T* first, const T* last)
      : storage_(first, last), data_(storage_.data()), size_(storage_.size()) {}
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

 private:
  std::vector<T> storage_;
  std::shared_ptr<void> owner_;
  T* data_;
  std::size_t size_;
};

}  // namespace troupe::messages
