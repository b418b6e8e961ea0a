// Rendezvous: how the processes of one job find each other before any actor runs. Rank 0 listens
// on TCP; every other rank connects, sends a hello (job token, protocol version, coordinates,
// host, UCX worker address) and waits. Rank 0 refuses a wrong hello with a reason and keeps
// waiting; once every rank joined it sends all of them the same welcome (every peer, by rank).
// Frames are Cap'n Proto messages (messages/rendezvous.capnp) read with explicit size limits.
// No CAF; blocking calls, each bounded by rendezvous_options::timeout. docs/operations.md,
// "Job token and rendezvous", describes what a user sees.
//
// Invariants: a welcome lists world peers with ranks 0..world-1 in order; rank 0 never waits on
// one connection (all are polled, each hello has its own deadline), never trusts a peer's sizes,
// and compares tokens in constant time.
#pragma once

#include <chrono>
#include <stdexcept>
#include <string>
#include <vector>

#include "messages/remote.hpp"

namespace troupe::transport {

struct rendezvous_error : std::runtime_error {
  using std::runtime_error::runtime_error;
};

struct rendezvous_options {
  std::string addr = "127.0.0.1";  // rank 0 binds exactly this address (loopback unless the job
                                   // spans machines); a host name or a numeric IPv4/IPv6 address
  int port = 0;                    // 1-65535
  std::chrono::milliseconds timeout{120000};  // every wait has this deadline
};

// Limits a hello must keep (rank 0 refuses one that does not; joiners check their own first).
inline constexpr std::size_t max_host_bytes = 255;
inline constexpr std::size_t max_worker_address_bytes = 4096;
inline constexpr std::size_t max_device_bytes = 64;
inline constexpr std::size_t max_resume_bytes = 512;
// NCCL ids a welcome carries at most (one per communicator between processes: pipeline and tied
// wte links, data-parallel and tensor groups), of these bytes.
// (Rank 0's NCCL keeps a bootstrap thread and socket per id until both ends have joined.)
inline constexpr std::size_t max_nccl_ids = 256;
inline constexpr std::size_t nccl_id_bytes = 128;

// Whether NCCL can link the processes of a welcome: every one has a device and no two share one
// (host and device); "" if so, else why not ("ranks 0 and 1 share device ... on host ...").
std::string nccl_obstacle(const std::vector<messages::peer_address>& peers);

// Rank 0: listen on addr:port, accept hellos until all `own.coords.world` processes joined with
// the right token, protocol version, world size and a rank not yet taken. A wrong hello gets a
// refusal with the reason ("job token does not match", "protocol version 2, this job speaks 1",
// "rank 3 already joined", "world size 8, this job has 4") and its connection is closed; the
// job is not disturbed and keeps waiting for the right process. When all joined: send each the
// welcome (all peers by rank, and own.nccl_ids where nccl_obstacle finds none), close, and
// return it. Throws rendezvous_error naming the ranks
// still missing at the deadline, or the address if it cannot listen.
messages::welcome rendezvous_serve(const rendezvous_options& o, const messages::hello& own);

// Other ranks: connect to addr:port (retrying until the deadline while rank 0 is not up yet),
// send hello, wait for the welcome. Throws rendezvous_error("rendezvous at ADDR:PORT refused this
// process: <reason>") on a refusal, or naming the address on a timeout.
messages::welcome rendezvous_join(const rendezvous_options& o, const messages::hello& own);

}  // namespace troupe::transport
