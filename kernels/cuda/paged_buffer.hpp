// Device memory at a fixed address whose physical memory comes and goes by range: ZeRO-3 keeps a
// chunk's flat parameter buffers whole in address (the kernels' offsets stay), while only the
// buckets gathered for their use hold memory. CUDA's virtual memory management
// (cuMemAddressReserve, cuMemCreate, cuMemMap), resolved through the runtime's driver entry points,
// so nothing links libcuda.
//
// Invariants:
//  - The address range is reserved once; memory is mapped in granules (the device's allocation
//    granularity, 2 MiB on current GPUs). A granule is mapped while any byte of it is held.
//  - Everything is held at construction. release(offset, bytes, stream) lets go of a range: a
//    granule no longer held is unmapped only once the work enqueued on `stream` so far (what read
//    or wrote it) is done, at the first call after that; acquire() of it before then keeps its
//    mapping. Where the device is out of memory, acquire() waits for the releases still pending
//    and tries again. The destructor waits for the device's work first.
//  - Every device that can reach this one directly (peer access) may read and write it. Ranges
//  released are acquired whole, and one byte is never held twice. Every
//    release names the same stream (the chunk's), so events pass in the order they were made.
//  - An acquired range's contents are unspecified until written.
//  - Not thread-safe: one owner (a chunk, on its stage's thread).
#pragma once

#include <cstddef>
#include <cstdint>
#include <deque>
#include <utility>
#include <vector>

namespace troupe::kernels::cuda {

class paged_buffer {
 public:
  // `bytes` on `device` (the current device while this is used), all of it mapped. Throws
  // cuda_error naming the call where the device or driver has no virtual memory management.
  paged_buffer(int device, std::size_t bytes);
  // Whether the device and driver have CUDA's virtual memory management.
  static bool supported(int device);
  ~paged_buffer();
  paged_buffer(const paged_buffer&) = delete;
  paged_buffer& operator=(const paged_buffer&) = delete;

  void* data() const { return reinterpret_cast<void*>(base_); }
  std::size_t size() const { return bytes_; }
  void release(std::size_t offset, std::size_t bytes, void* stream);
  void acquire(std::size_t offset, std::size_t bytes);
  // A round of releases and acquires begins: waits until the releases made before the previous
  // round are past on the stream, and unmaps what they let go of. Called once per parameter use,
  // it keeps the host at most two uses ahead of the device in memory (as FSDP's
  // limit_all_gathers does), so the mapped granules stay close to those of the buckets held.
  void next_round();
  // Granules mapped now, after unmapping those whose release the stream has passed.
  std::size_t mapped_bytes();
  std::size_t granularity() const { return granule_; }

 private:
  struct pending {  // granules let go of once `event` has passed
    void* event = nullptr;
    std::uint64_t round = 0;
    std::vector<std::pair<std::size_t, std::uint64_t>> granules;  // (granule, its release)
  };
  template <class F>
  void for_each_granule(std::size_t offset, std::size_t bytes, F f) const;
  std::size_t granule_bytes(std::size_t g) const;  // of the buffer in granule g
  void map(std::size_t g);
  void unmap(std::size_t g);
  void unmap_all() noexcept;  // and the address range
  // Unmaps what passed events, waiting for those of rounds before `wait_before`.
  void reap(std::uint64_t wait_before);

  int device_ = 0;
  std::size_t bytes_ = 0, granule_ = 0;
  std::uintptr_t base_ = 0;
  std::vector<int> access_;  // devices granted access
  std::size_t reserved_ = 0;
  std::vector<std::size_t> held_;           // by granule: bytes held
  std::vector<unsigned long long> handle_;  // by granule: 0 while unmapped
  std::vector<std::uint64_t> released_;     // by granule: times it was let go of
  std::deque<pending> pending_;             // in stream order
  std::uint64_t round_ = 0;
};

}  // namespace troupe::kernels::cuda
