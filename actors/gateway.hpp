// One process's bridge to the other processes of a job. Remote actors appear locally as proxies
// (untyped actors that accept the messages their original accepts); a proxy posts each message
// to the gateway, a detached actor that owns the process's UCX worker: it encodes messages as
// Cap'n Proto frames (messages/wire_codec.hpp, tensor payloads referenced), sends them, decodes
// received frames in place and delivers them to local actors as ordinary CAF messages. Stage,
// loader, reducer and coordinator code cannot tell a proxy from a local actor.
//
// Liveness: the gateway monitors its process's actors and tells every other process when one
// stops (actor_down), so the proxy of that actor stops with the same reason. Rank 0 and every
// other process exchange heartbeats; a peer silent for `peer_timeout`, a failed send or a UCX
// endpoint error marks that peer lost: every proxy of its actors stops naming the rank, and a
// process that lost rank 0 reports it to its client and ends.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "messages/protocols.hpp"
#include "messages/wire_codec.hpp"

namespace troupe::transport {
class ucx_transport;
}

namespace troupe::actors {

struct gateway_config {
  int rank = 0, world = 1;
  std::vector<std::string> hosts;  // by rank, for messages
  messages::wire::limits limits;
  std::chrono::milliseconds heartbeat_interval{500};
  std::chrono::milliseconds peer_timeout{10000};
};

struct mesh_state;

class remote_mesh {
 public:
  // The transport must already be connected to every peer.
  remote_mesh(std::unique_ptr<transport::ucx_transport> transport, gateway_config config);
  ~remote_mesh();
  remote_mesh(const remote_mesh&) = delete;
  remote_mesh& operator=(const remote_mesh&) = delete;

  int rank() const;
  // A stand-in for actor `id` of process `rank`.
  caf::actor make_proxy(caf::actor_system& sys, std::uint32_t id, int rank, std::string name);
  // An actor of this process that remote peers address as `id`.
  void add_local(std::uint32_t id, caf::actor actor, std::string name);
  // A receiver of this process that is no actor (a tensor group member, whose stage waits in a
  // collective): the gateway's thread calls `sink` with each message to `id`; it must not block.
  void add_sink(std::uint32_t id, std::function<void(messages::wire::body&&)> sink,
                std::string name);
  // Starts the gateway; call after every proxy and local actor exists and local wiring was sent.
  // `client` gets run_finished when the job ends from elsewhere: job_shutdown from rank 0, or
  // rank 0 lost.
  void start(caf::actor_system& sys, caf::actor client);
  // Thread-safe: message for actor `id` (0: the gateway itself) in process `rank`.
  void post(int rank, messages::wire::envelope e);
  // Rank 0: tells every other process that the job ended. Then (any rank) sends what is queued,
  // stops the gateway and waits for it (bounded). Safe to call twice.
  void shutdown(bool ok, const std::string& message);

 private:
  std::shared_ptr<mesh_state> state_;
};

}  // namespace troupe::actors
