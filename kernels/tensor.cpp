// Tensor storage and dtype conversions. See tensor.hpp for the invariants.
#include "kernels/tensor.hpp"

#include <sys/mman.h>

#include <algorithm>
#include <bit>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <new>
#include <stdexcept>

namespace troupe::kernels {

std::size_t dtype_size(dtype t) {
  switch (t) {
    case dtype::f32:
      return 4;
    case dtype::bf16:
    case dtype::f16:
      return 2;
  }
  return 0;
}

std::string_view dtype_name(dtype t) {
  switch (t) {
    case dtype::f32:
      return "f32";
    case dtype::bf16:
      return "bf16";
    case dtype::f16:
      return "f16";
  }
  return "?";
}

std::int64_t shape_numel(const shape_t& shape) {
  std::int64_t n = 1;
  for (auto d : shape) {
    if (d < 0) throw std::invalid_argument("negative dimension in shape " + shape_string(shape));
    if (d != 0 && n > INT64_MAX / d) {
      throw std::invalid_argument("shape " + shape_string(shape) + " has too many elements");
    }
    n *= d;
  }
  return n;
}

std::string shape_string(const shape_t& shape) {
  std::string s = "[";
  for (std::size_t i = 0; i < shape.size(); ++i) {
    if (i) s += ", ";
    s += std::to_string(shape[i]);
  }
  return s + "]";
}

tensor tensor::empty(shape_t shape, dtype type) {
  tensor t;
  t.numel_ = shape_numel(shape);
  t.shape_ = std::move(shape);
  t.type_ = type;
  std::size_t bytes = (t.nbytes() + 63) / 64 * 64;
  if (bytes == 0) bytes = 64;
  void* p = std::aligned_alloc(64, bytes);
  if (!p) throw std::bad_alloc();
  t.storage_ =
      std::shared_ptr<std::byte>(static_cast<std::byte*>(p), [](std::byte* q) { std::free(q); });
  t.data_ = p;
  return t;
}

tensor tensor::mapped_zeros(shape_t shape, dtype type) {
  tensor t;
  t.numel_ = shape_numel(shape);
  t.shape_ = std::move(shape);
  t.type_ = type;
  const std::size_t bytes = std::max<std::size_t>(t.nbytes(), 1);
  void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) throw std::bad_alloc();
  t.storage_ = std::shared_ptr<std::byte>(static_cast<std::byte*>(p),
                                          [bytes](std::byte* q) { ::munmap(q, bytes); });
  t.data_ = p;
  return t;
}

tensor tensor::zeros(shape_t shape, dtype type) {
  tensor t = empty(std::move(shape), type);
  t.fill_zero();
  return t;
}

tensor tensor::borrow(void* data, shape_t shape, dtype type, device_kind device) {
  tensor t;
  t.numel_ = shape_numel(shape);
  t.shape_ = std::move(shape);
  t.type_ = type;
  t.device_ = device;
  t.data_ = data;
  return t;
}

tensor tensor::view(std::int64_t offset, shape_t shape) const {
  const std::int64_t n = shape_numel(shape);
  if (offset < 0 || offset + n > numel_) {
    throw std::out_of_range("tensor view " + shape_string(shape) + " at offset " +
                            std::to_string(offset) + " exceeds " + shape_string(shape_));
  }
  tensor t = *this;
  t.data_ = static_cast<std::byte*>(data_) + static_cast<std::size_t>(offset) * dtype_size(type_);
  t.shape_ = std::move(shape);
  t.numel_ = n;
  return t;
}

float* tensor::f32() const {
  if (type_ != dtype::f32) {
    throw std::logic_error("tensor is " + std::string(dtype_name(type_)) + ", not f32");
  }
  return static_cast<float*>(data_);
}

void tensor::fill_zero() const {
  if (device_ != device_kind::cpu) throw std::logic_error("fill_zero on a non-CPU tensor");
  if (numel_ > 0) std::memset(data_, 0, nbytes());
}

void transpose_2d(float* dst, const float* src, std::int64_t rows, std::int64_t cols) {
  for (std::int64_t r = 0; r < rows; ++r) {
    for (std::int64_t c = 0; c < cols; ++c) dst[c * rows + r] = src[r * cols + c];
  }
}

float bf16_to_f32(std::uint16_t x) { return std::bit_cast<float>(std::uint32_t{x} << 16); }

std::uint16_t f32_to_bf16(float x) {
  std::uint32_t u = std::bit_cast<std::uint32_t>(x);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<std::uint16_t>((u >> 16) | 0x40);  // NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<std::uint16_t>(u >> 16);
}

float f16_to_f32(std::uint16_t h) {
  const std::uint32_t sign = (std::uint32_t{h} & 0x8000u) << 16;
  std::uint32_t exp = (h >> 10) & 0x1f;
  std::uint32_t mant = h & 0x3ffu;
  std::uint32_t bits;
  if (exp == 0) {
    if (mant == 0) {
      bits = sign;
    } else {  // subnormal: normalise
      exp = 127 - 15 + 1;
      while ((mant & 0x400u) == 0) {
        mant <<= 1;
        --exp;
      }
      mant &= 0x3ffu;
      bits = sign | (exp << 23) | (mant << 13);
    }
  } else if (exp == 0x1f) {
    bits = sign | 0x7f800000u | (mant << 13);
  } else {
    bits = sign | ((exp + 127 - 15) << 23) | (mant << 13);
  }
  return std::bit_cast<float>(bits);
}

std::uint16_t f32_to_f16(float f) {
  const std::uint32_t u = std::bit_cast<std::uint32_t>(f);
  const std::uint32_t sign = (u >> 16) & 0x8000u;
  const std::uint32_t abs = u & 0x7fffffffu;
  if (abs > 0x7f800000u) return static_cast<std::uint16_t>(sign | 0x7e00u);   // NaN
  if (abs >= 0x477ff000u) return static_cast<std::uint16_t>(sign | 0x7c00u);  // overflow -> inf
  if (abs < 0x38800000u) {  // subnormal or zero in f16
    if (abs < 0x33000000u) return static_cast<std::uint16_t>(sign);
    const std::uint32_t e = abs >> 23;
    const std::uint32_t m = (abs & 0x7fffffu) | 0x800000u;
    const std::uint32_t shift = 126 - e;  // 14 - (e - 112)
    std::uint32_t r = m >> (shift - 10 + 10);
    const std::uint32_t rem = m & ((1u << shift) - 1);
    const std::uint32_t half = 1u << (shift - 1);
    if (rem > half || (rem == half && (r & 1u))) ++r;
    return static_cast<std::uint16_t>(sign | r);
  }
  std::uint32_t r = ((abs >> 13) - ((127 - 15) << 10));
  const std::uint32_t rem = abs & 0x1fffu;
  if (rem > 0x1000u || (rem == 0x1000u && (r & 1u))) ++r;
  return static_cast<std::uint16_t>(sign | r);
}

}  // namespace troupe::kernels
