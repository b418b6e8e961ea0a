// Messages that exist only because a job spans processes: membership, liveness, failures,
// ring collectives between replicas and request/response across a gateway. CAF-free, like
// messages/pipeline.hpp. Their wire form is messages/wire.capnp (codec: messages/wire_codec.hpp);
// hello/welcome/refusal travel during rendezvous (transport/rendezvous.hpp).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "messages/pipeline.hpp"

namespace troupe::messages {

// Bumped whenever a schema in messages/*.capnp changes incompatibly. Rendezvous refuses a process
// that speaks another version.
inline constexpr std::uint32_t protocol_version = 4;

// Where a process sits in the job's mesh.
struct mesh_coords {
  int rank = 0, world = 1;  // process rank and count
  int replica = 0;          // data-parallel replica of its first stage
  int pipeline_rank = 0;    // pipeline rank of its first stage actor
};

// A process asks to join the job (sent to rank 0 during rendezvous).
struct hello {
  std::uint32_t version = protocol_version;
  std::string job_token;
  mesh_coords coords;
  std::string host;
  std::vector<std::uint8_t> worker_address;  // UCX worker address blob
  std::string device;  // the CUDA device of its chunks (PCI bus id, NCCL host id); empty: none
  // The checkpoint it resumes (engine::checkpoint_identity); empty: a fresh start. Rank 0
  // refuses a process that names another one, and ends the rendezvous, naming both.
  std::string resume;
  // Rank 0 only (never sent): NCCL unique ids (128 bytes each) it offers, one per communicator
  // between processes (links and groups, in actors/pipeline_wiring.hpp's nccl_plan order), for
  // the welcome.
  std::vector<std::vector<std::uint8_t>> nccl_ids;
};
// Everyone's address, once all `world` processes have joined.
struct peer_address {
  int rank = 0;
  std::string host;
  std::vector<std::uint8_t> worker_address;
  std::string device;
};
struct welcome {
  std::vector<peer_address> peers;  // by rank
  // Rank 0's offered NCCL ids, when every process has a device and no two share one (NCCL
  // refuses two ranks of a communicator on one device); else empty.
  std::vector<std::vector<std::uint8_t>> nccl_ids;
};
// Rendezvous refused this process (wrong token, version, rank or world size).
struct refusal {
  std::string reason;
};

// Liveness, both ways between rank 0 and every other process.
struct heartbeat {
  int rank = 0;
  std::uint64_t sequence = 0;
};

// An actor of another process stopped (its gateway saw it go down), or its process was lost.
struct actor_down {
  std::uint32_t actor = 0;  // job-wide actor id
  std::string reason;
};

// A process reports a failure it cannot turn into an actor_down (codec error, lost peer).
struct error_report {
  int rank = 0;
  std::string message;
};

// Rank 0 ends the job; every gateway stops its process's actors and returns.
struct job_shutdown {
  bool ok = true;
  std::string message;
};

// One step of a ring reduce-scatter (phase 0) or all-gather (phase 1) between the replicas of a
// pipeline rank: chunk `chunk` of bucket `bucket`, holding a partial sum (phase 0) or the
// final mean (phase 1).
struct ring_chunk {
  int step = 0, rank = 0, bucket = 0;
  int from_replica = 0;
  int phase = 0;  // 0 reduce-scatter, 1 all-gather
  int chunk = 0;
  float_buffer data;
  int collective = 0;  // ZeRO: a zero_collective (bucket = gather number unless 0); DDP: 0
};

// One member's part of a tensor-group collective between processes
// (topology/tensor_exchange.hpp): collective number `seq` of the group, member `from`'s buffer
// (float sums and maxima as they are; double sums as their bytes, two floats a double), or, with
// op abort, the reason a member stopped (data empty).
struct tensor_exchange {
  enum class op : int { sum_f32 = 0, sum_f64 = 1, max_f32 = 2, abort = 3 };
  std::uint64_t seq = 0;
  int from = 0;
  op kind = op::sum_f32;
  float_buffer data;
  std::string reason;
};

// A piece of a checkpoint file sent to the writer (schema reserved for the checkpoint issue).
struct checkpoint_chunk {
  int step = 0;
  std::string file;
  std::uint64_t offset = 0;
  std::uint64_t xxhash = 0;
  float_buffer data;
};

}  // namespace troupe::messages
