// See tied_wte.hpp.
#include "topology/tied_wte.hpp"

#include <algorithm>
#include <stdexcept>
#include <utility>

namespace troupe::topology {

tied_wte::tied_wte(engine::rank_chunks& chunks, const grad_buckets& buckets, int embedding_chunk,
                   int head_chunk, std::shared_ptr<engine::chunk_link> send,
                   std::shared_ptr<engine::chunk_link> receive, std::string who)
    : chunks_(&chunks), send_(std::move(send)), receive_(std::move(receive)), who_(std::move(who)) {
  if (embedding_chunk >= 0 && embedding_chunk == head_chunk) return;  // one chunk, both ends
  for (int c : {embedding_chunk, head_chunk}) {
    if (c < 0) continue;
    const auto& layout = chunks.layout(c);
    const auto p = std::find_if(layout.begin(), layout.end(), [](const auto& info) {
      return info.name == "transformer.wte.weight";
    });
    if (p == layout.end())
      throw std::logic_error(who_ + ": chunk " + std::to_string(c) + " has no wte");
    copies_.push_back({c, p->offset, buckets.bucket_containing(chunks.gradients(c) + p->offset)});
    numel_ = p->numel;
  }
}

bool tied_wte::holds(int bucket) const {
  return std::any_of(copies_.begin(), copies_.end(),
                     [bucket](const copy& c) { return c.bucket == bucket; });
}

void tied_wte::start() {
  partner_.reset();
  sent_ = nullptr;
  received_ = false;
  ready_ = 0;
  done_ = copies_.empty();
}

float* tied_wte::grads(int i) const {
  const auto& c = copies_.at(static_cast<std::size_t>(i));
  return chunks_->gradients(c.chunk) + c.offset;
}

std::optional<messages::float_buffer> tied_wte::bucket_final(int bucket) {
  if (done_ || !holds(bucket)) return std::nullopt;
  if (++ready_ < copies()) return std::nullopt;
  if (copies() == 2) {  // both copies here: a = a + h, then h = a
    const auto& a = copies_[0];
    const auto& h = copies_[1];
    chunks_->wait_event(a.chunk, chunks_->record_event(h.chunk));
    chunks_->add_gradients(a.chunk, a.offset, grads(1), numel_);
    chunks_->wait_event(h.chunk, chunks_->record_event(a.chunk));
    chunks_->copy_gradients(h.chunk, h.offset, grads(0), numel_);
    done_ = true;
    return std::nullopt;
  }
  const auto& own = copies_[0];
  messages::float_buffer out;
  if (device() && send_) {  // through the link, right before the header leaves
    sent_ = send_->send(grads(0), bytes(), chunks_->record_event(own.chunk));
  } else if (device()) {  // staged through the host, inside the message
    out = std::make_shared<messages::payload<float>>(static_cast<std::size_t>(numel_),
                                                     messages::payload<float>::for_overwrite);
    chunks_->copy_to_host(own.chunk, out->data(), grads(0), bytes());
  } else {
    const float* g = grads(0);
    out = std::make_shared<messages::payload<float>>(g, g + numel_);
  }
  finish();
  return out;
}

void tied_wte::received(const messages::float_buffer& data) {
  if (copies() != 1)
    throw std::logic_error(who_ + ": a tied wte gradient for a rank without one copy");
  if (device()) {
    const int c = copies_[0].chunk;
    float* scratch = chunks_->gradient_scratch(c, numel_);
    if (data) {  // staged through the host
      if (static_cast<std::int64_t>(data->size()) != numel_)
        throw std::runtime_error(who_ + ": a tied wte gradient of " + std::to_string(data->size()) +
                                 " values, not " + std::to_string(numel_));
      chunks_->copy_from_host(c, scratch, data->data(), bytes());
    } else {
      if (!receive_)
        throw std::runtime_error(who_ +
                                 ": a tied wte gradient without data, and no device link from "
                                 "the partner to receive it by");
      void* got = receive_->receive(scratch, bytes(), chunks_->record_event(c));
      chunks_->wait_event(c, got);
    }
  } else {
    if (!data)
      throw std::runtime_error(who_ +
                               ": a tied wte gradient without data (a CPU stage takes its "
                               "partner's copy inside the message)");
    partner_ = data;
  }
  received_ = true;
  finish();
}

// Own + other, once both are here and ours has left.
void tied_wte::finish() {
  if (done_ || !received_ || ready_ < 1) return;
  const auto& own = copies_[0];
  const float* other = device() ? chunks_->gradient_scratch(own.chunk, numel_) : partner_->data();
  if (sent_) chunks_->wait_event(own.chunk, std::exchange(sent_, nullptr));
  chunks_->add_gradients(own.chunk, own.offset, other, numel_);
  partner_.reset();
  received_ = false;
  done_ = true;
}

}  // namespace troupe::topology
