// Sends a ring collective's outgoing chunks (topology/ring_feed.hpp) to the next replica's actor
// as ring_chunk messages: shared by the ring reducer and the ZeRO shard.
#pragma once

#include <vector>

#include "messages/protocols.hpp"
#include "topology/collectives.hpp"

namespace troupe::actors {

inline void send_ring_chunks(const caf::actor& next, int step, int rank, int bucket, int replica,
                             std::vector<topology::ring_allreduce::send> sends,
                             int collective = 0) {
  for (auto& s : sends) {
    messages::ring_chunk m;
    m.step = step;
    m.rank = rank;
    m.bucket = bucket;
    m.from_replica = replica;
    m.phase = s.phase;
    m.chunk = s.chunk;
    m.collective = collective;
    m.data = std::move(s.data);
    caf::anon_send(next, std::move(m));
  }
}

}  // namespace troupe::actors
