// Tensor: a shape, a dtype, a device and storage that is either owned (shared, 64-byte aligned)
// or borrowed (someone else keeps it alive). Views share the owner's storage.
// Invariants: data() is 64-byte aligned for owned tensors; numel() == product of shape;
// a borrowed tensor never frees its memory. No actor, no CAF: this is the bottom layer.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace troupe::kernels {

enum class dtype : std::uint8_t { f32, bf16, f16 };
enum class device_kind : std::uint8_t { cpu, cuda };

std::size_t dtype_size(dtype t);
std::string_view dtype_name(dtype t);

using shape_t = std::vector<std::int64_t>;

std::int64_t shape_numel(const shape_t& shape);
std::string shape_string(const shape_t& shape);

class tensor {
 public:
  tensor() = default;

  // A new owning CPU tensor; contents uninitialised (empty) or zero (zeros).
  static tensor empty(shape_t shape, dtype type = dtype::f32);
  static tensor zeros(shape_t shape, dtype type = dtype::f32);
  // A zero tensor in a private anonymous mapping of its own (page-aligned), whose pages can be
  // handed back to the kernel or moved (engine::release_zeroed, engine::page_pool).
  static tensor mapped_zeros(shape_t shape, dtype type = dtype::f32);
  // A tensor over memory that the caller keeps alive.
  static tensor borrow(void* data, shape_t shape, dtype type = dtype::f32,
                       device_kind device = device_kind::cpu);

  // A view of numel(shape) elements starting offset elements into this tensor.
  tensor view(std::int64_t offset, shape_t shape) const;

  const shape_t& shape() const { return shape_; }
  int rank() const { return static_cast<int>(shape_.size()); }
  std::int64_t dim(int i) const { return shape_.at(static_cast<std::size_t>(i)); }
  std::int64_t numel() const { return numel_; }
  std::size_t nbytes() const { return static_cast<std::size_t>(numel_) * dtype_size(type_); }
  dtype type() const { return type_; }
  device_kind device() const { return device_; }
  bool owns_storage() const { return storage_ != nullptr; }

  void* data() const { return data_; }
  float* f32() const;  // checks dtype::f32
  template <class T>
  T* data_as() const {
    return static_cast<T*>(data_);
  }

  void fill_zero() const;

 private:
  std::shared_ptr<std::byte> storage_;
  void* data_ = nullptr;
  shape_t shape_;
  std::int64_t numel_ = 0;
  dtype type_ = dtype::f32;
  device_kind device_ = device_kind::cpu;
};

// dst[cols, rows] = src[rows, cols]^T (row-major). Hugging Face Conv1D <-> [out, in] layout.
void transpose_2d(float* dst, const float* src, std::int64_t rows, std::int64_t cols);

// bf16 / f16 <-> f32 conversions (round to nearest even), for import and export.
float bf16_to_f32(std::uint16_t x);
std::uint16_t f32_to_bf16(float x);
float f16_to_f32(std::uint16_t x);
std::uint16_t f32_to_f16(float x);

}  // namespace troupe::kernels
