// One NCCL communicator (a DP or TP group, or a pipeline link) with its own stream
// (docs/gpu.md). Host code; needs the CUDA and NCCL headers, not nvcc.
//
// Invariants:
//  - The communicator is non-blocking (ncclConfig_t.blocking = 0): no NCCL call can hang the
//    caller. Joining and every wait have a deadline; when it passes, or NCCL reports an
//    asynchronous error, the communicator is aborted (ncclCommAbort, which also tears down
//    kernels stuck on a dead peer) and nccl_error says which group, rank and operation.
//  - Collectives and send/recv run on the group's own stream, ordered after the compute
//    stream's work by an event (`after`), so compute continues while they run; done() gives an
//    event the compute stream waits on before it reads the result.
//  - A broken (aborted) group refuses further work with the reason it broke.
#pragma once

#include <cuda_runtime_api.h>

#include <array>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "kernels/cuda/cuda_ops.hpp"

namespace troupe::kernels::cuda {

struct nccl_error : cuda_error {
  using cuda_error::cuda_error;
};

// ncclUniqueId as bytes, to travel in the rendezvous message from rank 0 to the others.
using nccl_id = std::array<char, 128>;
nccl_id nccl_new_id();
// An id that travelled as bytes, for the communicator `name`; throws std::invalid_argument naming
// it when the bytes are not an id's 128.
nccl_id nccl_id_from(const std::string& name, const std::vector<std::uint8_t>& bytes);
// "2.28.x" of the NCCL library linked.
std::string nccl_version();
// NCCL_HOSTID from this process's environment (none when unset; set but empty is a host id too,
// as NCCL takes it). NCCL tells hosts apart by it where it is set, not by their names: two
// processes on one device with different host ids are two hosts to it (joined by its network
// transport), not a duplicate device.
std::optional<std::string> nccl_host_id();

class nccl_group {
 public:
  // Joins the group `name` of `ranks` ranks as `rank`, on CUDA device `device`; waits up to
  // `join_timeout` for all ranks, then aborts and throws nccl_error naming the group.
  nccl_group(std::string name, const nccl_id& id, int ranks, int rank, int device,
             std::chrono::milliseconds join_timeout);
  ~nccl_group();
  nccl_group(const nccl_group&) = delete;
  nccl_group& operator=(const nccl_group&) = delete;

  const std::string& name() const { return name_; }
  int rank() const { return rank_; }
  int size() const { return ranks_; }
  cudaStream_t stream() const { return stream_; }
  bool broken() const { return !broken_reason_.empty(); }

  // Enqueued on the group's stream after `after` (an event of the producing stream; nullptr:
  // no ordering). They return at once.
  void all_reduce_sum(float* data, std::int64_t n, cudaEvent_t after);
  // In place, of n elements of `type` (the tensor-parallel collectives: activations in the
  // compute dtype, fp32 statistics).
  enum class element { f32, bf16, f16 };
  enum class reduction { sum, max };
  void all_reduce(void* data, std::int64_t n, element type, reduction op, cudaEvent_t after);
  void reduce_scatter_sum(const float* in, float* out, std::int64_t per_rank, cudaEvent_t after);
  void all_gather(const float* in, float* out, std::int64_t per_rank, cudaEvent_t after);
  void send(const void* data, std::size_t bytes, int peer, cudaEvent_t after);
  void recv(void* data, std::size_t bytes, int peer, cudaEvent_t after);

  // A new communicator `name` of devices.size() ranks, rank i on devices[i], all in this
  // process (a join waits for the other ranks, so each rank joins on its own thread).
  static std::vector<std::unique_ptr<nccl_group>> join_all(
      const std::string& name, const std::vector<int>& devices,
      std::chrono::milliseconds join_timeout = std::chrono::seconds(120));

  // One thread driving several ranks of one communicator (one process, a device per rank):
  // groups[i] all-reduces the mean (ncclAvg) of ranges[i] after after[i] (nullptr: no
  // ordering), all in one ncclGroupStart/End so that no rank's call waits for another's. Returns
  // at once; each group's done() then marks the end of its part.
  using float_ranges = std::vector<std::pair<float*, std::int64_t>>;
  static void all_reduce_mean(const std::vector<nccl_group*>& groups,
                              const std::vector<float_ranges>& ranges,
                              const std::vector<cudaEvent_t>& after);

  // The same, by ring chunk of each rank's ranges (their concatenation of n floats cut into
  // chunk c = [n c / d, n (c + 1) / d) over the d ranks, owned by rank (c + d - 1) mod d, as
  // engine::zero_group says): reduce_mean averages chunk c into its owner's copy (ncclReduce,
  // ncclAvg; the other ranks' copies are left as they were), broadcast copies it from its
  // owner to every rank (ncclBroadcast). groups: ranks of one communicator (all of them, or a
  // process's one).
  enum class owned_op { reduce_mean, broadcast };
  static void owned_collective(const std::vector<nccl_group*>& groups,
                               const std::vector<float_ranges>& ranges,
                               const std::vector<cudaEvent_t>& after, owned_op op);

  // Connect this rank's channels now, and wait until they are (each rank on a thread or in a
  // process of its own, all at once, as when joining). NCCL connects a channel at its first
  // transfer, and that waits for the peer's first transfer: a first send enqueued in the middle
  // of training would wait for a receive that the peer posts only once it hears of the send.
  // connect_peer: one byte to (sending) or from `peer`. connect_collectives: an all-reduce of
  // one float over every rank, and owned_collective's reduce and broadcast rooted at each rank
  // (NCCL may still connect another algorithm at a later, larger collective; every rank calls
  // those anyway, so that waits on nobody's header).
  void connect_peer(int peer, bool sending, std::chrono::milliseconds timeout);
  void connect_collectives(std::chrono::milliseconds timeout);

  // An event recorded after everything enqueued so far (valid until the next done()).
  cudaEvent_t done();
  // Waits until everything enqueued has finished; past the deadline, or on an asynchronous
  // NCCL error, aborts and throws nccl_error naming the group, rank and `what`.
  void wait(std::chrono::milliseconds timeout, const std::string& what);
  // Tears the communicator down now (ncclCommAbort); later calls throw with `reason`.
  void abort(const std::string& reason);

 private:
  void settle(const char* op, std::chrono::steady_clock::time_point deadline);
  // Checks and orders every group after its event, then call(group, its ranges) for each inside
  // one ncclGroupStart/End (a failure aborts them all, naming `what`). call returns an
  // ncclResult_t.
  static void grouped(const std::vector<nccl_group*>& groups,
                      const std::vector<float_ranges>& ranges,
                      const std::vector<cudaEvent_t>& after, const char* what,
                      const std::function<int(nccl_group&, const float_ranges&)>& call);
  void usable(const char* op) const;
  void order_after(cudaEvent_t after);

  std::string name_;
  int ranks_ = 0, rank_ = 0, device_ = 0;
  void* comm_ = nullptr;  // ncclComm_t
  cudaStream_t stream_ = nullptr;
  cudaEvent_t done_ = nullptr;
  std::string broken_reason_;
};

}  // namespace troupe::kernels::cuda
