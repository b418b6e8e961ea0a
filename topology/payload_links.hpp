// How the payloads of a stage's link messages (activations and their gradients) cross to the
// peer rank, by the chunks' kind and the peer (docs/pipeline.md):
//  - CPU chunks: inside the message (the stage hands the payload in; nothing to receive);
//  - device chunks, a peer with a link (this process, or another by NCCL): through the pair's
//    chunk_link beside a header-only message. The payload enters the link right before its
//    header leaves (D1 in actors/stage.cpp), each link call ordered on the chunk's stream both
//    ways (D3), and the receiver posts its receive when the header arrives, in header order;
//  - device chunks, a peer without a link (another process): staged through host memory inside
//    the message, copied out of the sender's slot and into the receiver's.
// CAF-free: the stage actor sends and receives the messages.
#pragma once

#include <cstddef>
#include <map>
#include <memory>
#include <string>

#include "engine/chunks/device_chunk.hpp"
#include "engine/chunks/rank_chunks.hpp"
#include "messages/pipeline.hpp"

namespace troupe::topology {

class payload_links {
 public:
  using link_map = std::map<int, std::shared_ptr<engine::chunk_link>>;  // by peer rank
  payload_links() = default;
  // send, receive: this rank's ends of its links (device chunks), by peer rank (this rank itself
  // for a hop between two of its chunks). `who` names the rank in errors.
  payload_links(engine::rank_chunks& chunks, link_map send, link_map receive, std::string who);

  // The payload of `kind` that (c, id) sends to rank `to`, right before its header leaves:
  // returns the message's data: `data` itself (CPU chunks), null once the slot's payload is in
  // the link, or a host copy of it (staged).
  messages::float_buffer send(int c, engine::micro_batch_id id, engine::payload_kind kind, int to,
                              messages::float_buffer data);
  // A header from rank `from` for (c, id), of B x T tokens, arrived with `data` (or without):
  // device chunks receive the payload into the chunk's buffer, from the link or the staged copy.
  // Nothing for CPU chunks (the stage reads `data`). Throws when the data comes where a link is,
  // or is missing where none is.
  void receive(int c, engine::micro_batch_id id, engine::payload_kind kind, int B, int T, int from,
               const messages::float_buffer& data);

 private:
  bool device() const { return chunks_->kind() != "cpu"; }
  static engine::chunk_link* find(const link_map& links, int peer);

  engine::rank_chunks* chunks_ = nullptr;
  link_map send_, receive_;
  std::string who_;
};

}  // namespace troupe::topology
