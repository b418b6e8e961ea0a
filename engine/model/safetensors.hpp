// Safetensors files: an 8-byte little-endian header length, a JSON header naming each tensor's
// dtype, shape and byte range, then the raw little-endian data.
// Invariants: a reader never trusts the file — every offset, size and dtype is validated and
// any error names the file and tensor; a writer replaces its target atomically (tmp, fsync,
// rename), so a failed write never leaves a half-written file behind.
#pragma once

#include <cstdint>
#include <filesystem>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "kernels/tensor.hpp"

namespace troupe::engine {

struct safetensors_entry {
  std::string name;
  std::string dtype;  // "F32", "BF16", "F16", "I32", "I64", ...
  kernels::shape_t shape;
  const std::byte* data = nullptr;  // into the mapped file
  std::size_t nbytes = 0;
};

// A read-only, memory-mapped safetensors file.
class safetensors_file {
 public:
  explicit safetensors_file(const std::filesystem::path& path);
  ~safetensors_file();
  safetensors_file(const safetensors_file&) = delete;
  safetensors_file& operator=(const safetensors_file&) = delete;

  const std::filesystem::path& path() const { return path_; }
  const std::map<std::string, safetensors_entry>& entries() const { return entries_; }
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  bool contains(const std::string& name) const { return entries_.count(name) != 0; }
  const safetensors_entry& at(const std::string& name) const;

  // The tensor converted to f32 (F32, BF16 and F16 are accepted), as a new owning tensor.
  kernels::tensor read_f32(const std::string& name) const;
  // Integer tensors (I32, I64, U16) converted to int32.
  std::vector<std::int32_t> read_i32(const std::string& name) const;

 private:
  std::filesystem::path path_;
  void* map_ = nullptr;
  std::size_t map_size_ = 0;
  std::map<std::string, safetensors_entry> entries_;
  std::map<std::string, std::string> metadata_;
};

// Tensors to write: name -> f32 tensor (or i32 via dtype "I32"); written in name order.
// transposed_rows > 0 (F32 only): `data` holds the tensor's transpose, transposed_rows x
// (numel / transposed_rows) floats row-major, transposed while it is written (shape is the
// written tensor's).
struct safetensors_tensor {
  std::string dtype = "F32";
  kernels::shape_t shape;
  const void* data = nullptr;
  std::size_t nbytes = 0;
  std::int64_t transposed_rows = 0;
};
// What was written: the file's size and its xxh64 (seed 0), computed from the bytes as they
// were written.
struct file_digest {
  std::uint64_t bytes = 0, xxh64 = 0;
};
// Streams the file to path.tmp (each tensor straight from `data`, a transposed one through a
// small scratch), fsyncs and renames it into place; nothing is assembled in memory.
file_digest write_safetensors(const std::filesystem::path& path,
                              const std::map<std::string, safetensors_tensor>& tensors,
                              const std::map<std::string, std::string>& metadata = {});

// Atomic whole-file write: path.tmp, fsync, rename. Used by every writer of outputs.
file_digest write_file_atomically(const std::filesystem::path& path,
                                  const std::vector<std::byte>& bytes);

}  // namespace troupe::engine
