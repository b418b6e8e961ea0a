// See payload_links.hpp.
#include "topology/payload_links.hpp"

#include <stdexcept>
#include <utility>

namespace troupe::topology {

payload_links::payload_links(engine::rank_chunks& chunks, link_map send, link_map receive,
                             std::string who)
    : chunks_(&chunks),
      send_(std::move(send)),
      receive_(std::move(receive)),
      who_(std::move(who)) {}

engine::chunk_link* payload_links::find(const link_map& links, int peer) {
  const auto it = links.find(peer);
  return it == links.end() ? nullptr : it->second.get();
}

messages::float_buffer payload_links::send(int c, engine::micro_batch_id id,
                                           engine::payload_kind kind, int to,
                                           messages::float_buffer data) {
  if (!device()) return data;
  const std::size_t bytes = chunks_->payload_bytes(c, id);
  const void* from = chunks_->send_buffer(c, id, kind);
  if (engine::chunk_link* link = find(send_, to)) {  // D1, D3
    void* sent = link->send(from, bytes, chunks_->record_event(c));
    chunks_->wait_event(c, sent);
    return nullptr;
  }
  // Staged: whole floats (a 16-bit payload may end in a half).
  auto staged = std::make_shared<messages::payload<float>>(
      (bytes + sizeof(float) - 1) / sizeof(float), messages::payload<float>::for_overwrite);
  chunks_->copy_to_host(c, staged->data(), from, bytes);
  return staged;
}

void payload_links::receive(int c, engine::micro_batch_id id, engine::payload_kind kind, int B,
                            int T, int from, const messages::float_buffer& data) {
  if (!device()) return;
  engine::chunk_link* link = find(receive_, from);
  if (data && link)
    throw std::logic_error(who_ + ": a link message with host data from rank " +
                           std::to_string(from) + ", which has a link to this rank");
  if (!data && !link)
    throw std::logic_error(who_ + ": a link message without data from rank " +
                           std::to_string(from) + ", which has no link to this rank");
  void* into = chunks_->receive_buffer(c, id, kind, B, T);
  const std::size_t bytes = chunks_->payload_bytes(c, id);
  if (link) {
    void* received = link->receive(into, bytes, chunks_->record_event(c));
    chunks_->wait_event(c, received);
    return;
  }
  if (data->size() != (bytes + sizeof(float) - 1) / sizeof(float))
    throw std::runtime_error(who_ + ": a staged payload of " +
                             std::to_string(data->size() * sizeof(float)) + " bytes from rank " +
                             std::to_string(from) + "; the chunk holds " + std::to_string(bytes));
  chunks_->copy_from_host(c, into, data->data(), bytes);
}

}  // namespace troupe::topology
