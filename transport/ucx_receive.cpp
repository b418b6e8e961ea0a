// The receiving side of the UCX transport (ucx_transport_impl.hpp): UCX's AM callback, frames
// assembled in pool buffers, rendezvous receives under their bounds, delivery in each peer's
// order, and the dispatch of completions to the user's callbacks.
#include "transport/ucx_transport_impl.hpp"

#include <algorithm>
#include <cstring>

namespace troupe::transport {
using namespace ucx_detail;
namespace {

constexpr std::size_t max_receives_outstanding = 64;
constexpr std::size_t min_receives_outstanding = 2;
constexpr std::size_t max_receive_bytes_outstanding = std::size_t{4} << 20;
constexpr std::size_t max_local_receives_outstanding = 2;  // from a shared-memory peer
constexpr std::size_t max_local_receive_bytes_outstanding = std::size_t{1} << 20;  // (beyond one)

}  // namespace

void ucx_transport::impl::recv_done(void* request, ucs_status_t status, std::size_t,
                                    void* user_data) {
  auto* op = static_cast<recv_op*>(user_data);
  op->request = request;
  op->status = status;
  op->owner->completed_receives.push_back(op);
}

// An active message (inside ucp_worker_progress). A small frame (the whole frame in one eager
// message: control messages, latency probes) is copied into its buffer here and delivered in
// order from progress(), without a per-message record; any other message goes to arrived().
ucs_status_t ucx_transport::impl::am_arrived(void* arg, const void* header,
                                             std::size_t header_length, void* data,
                                             std::size_t length, const ucp_am_recv_param_t* param) {
  auto& self = *static_cast<impl*>(arg);
  const bool rendezvous = (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) != 0;
  if (header_length == 0 && !rendezvous) {
    // A small frame sent as one message's data (send()'s immediate path): the am_header and
    // the frame are the data, read here as header and inline bytes.
    header = data;
    header_length = length;
    length = 0;
  }
  // Dropped: a rendezvous sender then completes without moving its data.
  if (self.closing || header_length < sizeof(am_header)) return UCS_OK;
  am_header h;
  std::memcpy(&h, header, sizeof h);
  const int peer = static_cast<int>(h.rank);
  if (peer != self.last_inbound_peer) self.find_inbound(peer);
  inbound& in = *self.last_inbound;
  const auto* inline_at = static_cast<const std::byte*>(header) + sizeof h;
  const std::size_t inline_bytes = header_length - sizeof h;
  if (h.first == 0 || rendezvous || h.sequence != in.next_sequence || in.assembling ||
      inline_bytes + length != h.frame_bytes)
    return self.arrived(h, in, inline_at, inline_bytes, data, length, rendezvous,
                        (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_DATA) != 0);
  in.next_sequence = h.sequence + 1;
  small_frame& f = self.completed_small.emplace_back();
  f.in = &in;
  f.peer = peer;
  f.index = in.next_frame++;
  f.bytes = h.frame_bytes;
  if (self.spare_small && f.bytes <= self.spare_small->size())
    f.buffer = std::move(self.spare_small);
  else
    f.buffer = self.pool.take(f.bytes);
  self.last_small_bytes = f.bytes;
  if (inline_bytes > 0) std::memcpy(f.buffer->data(), inline_at, inline_bytes);
  if (length > 0) std::memcpy(f.buffer->data() + inline_bytes, data, length);
  return UCS_OK;
}

void ucx_transport::impl::find_inbound(int peer) {
  last_inbound = &inbounds[peer];
  last_inbound_peer = peer;
}

// A message of a frame of several messages, or of one too long to be small. It lands (land())
// now unless earlier messages wait, or it is a rendezvous one past the outstanding bounds; then
// it waits in `deferred`. A frame's buffer is taken when its first message lands, so frames
// waiting in UCX hold no buffer (32 frames of 1 MiB in flight each with their own buffer ran at
// about half the bandwidth of 4 at a time: the receive working set fell out of cache).
ucs_status_t ucx_transport::impl::arrived(const am_header& h, inbound& in,
                                          const std::byte* inline_at, std::size_t inline_bytes,
                                          void* data, std::size_t length, bool rendezvous,
                                          bool persistent) {
  const int peer = static_cast<int>(h.rank);
  frame_state* frame = frame_of(in, peer, h, inline_bytes + length);
  if (!frame) return UCS_OK;
  recv_op* op = receives.take();
  op->owner = this;
  op->peer = peer;
  op->in = &in;
  op->frame = frame;
  op->offset = frame->posted;
  op->inline_bytes = inline_bytes;
  op->bytes = length;
  op->rendezvous = rendezvous;
  frame->posted += inline_bytes + length;
  if (frame->posted == frame->bytes) in.assembling = nullptr;
  ++frame->pending;
  if (deferred.empty() && (!rendezvous || room_to_receive(*op))) {
    land(op, inline_at, data);
    return UCS_OK;  // UCX keeps the descriptor of a started rendezvous receive
  }
  op->held.assign(inline_at, inline_at + inline_bytes);
  deferred.push_back(op);
  if (rendezvous || (persistent && length > 0)) {
    op->desc = data;
    return UCS_INPROGRESS;
  }
  const auto* bytes = static_cast<const std::byte*>(data);
  op->held.insert(op->held.end(), bytes, bytes + length);
  return UCS_OK;
}

// Writes a message's inline bytes and eager data to its offset in the frame's buffer (taken
// now if this is the frame's first message to land), or starts its rendezvous receive there.
// data: the eager bytes or the rendezvous descriptor; nullptr when `held` has the bytes.
void ucx_transport::impl::land(recv_op* op, const std::byte* inline_at, void* data) {
  frame_state* frame = op->frame;
  if (!frame->buffer) frame->buffer = pool.take(frame->bytes);
  std::byte* at = frame->buffer->data() + op->offset;
  if (op->inline_bytes > 0) std::memcpy(at, inline_at, op->inline_bytes);
  at += op->inline_bytes;
  if (op->rendezvous) return start_receive(op, data, at);
  if (op->bytes > 0) std::memcpy(at, data ? data : op->held.data() + op->inline_bytes, op->bytes);
  op->status = UCS_OK;
  completed_receives.push_back(op);
}

// Which frame a message belongs to; nullptr (and a peer error) if it breaks the protocol.
ucx_transport::impl::frame_state* ucx_transport::impl::frame_of(inbound& in, int peer,
                                                                const am_header& h,
                                                                std::size_t bytes) {
  std::string error;
  if (h.sequence != in.next_sequence)
    error = "message " + std::to_string(h.sequence) + " arrived where " +
            std::to_string(in.next_sequence) + " was due";
  else if ((h.first != 0) == (in.assembling != nullptr))
    error = h.first ? "a frame started inside another" : "a frame part arrived without a frame";
  in.next_sequence = h.sequence + 1;
  if (error.empty() && h.first) {
    in.assembling = frames.take();
    in.assembling->index = in.next_frame++;
    in.assembling->bytes = h.frame_bytes;
    in.assembling->peer = peer;
    in.assembling->in = &in;
  }
  if (error.empty() && in.assembling->posted + bytes > in.assembling->bytes)
    error = "frame parts exceed the frame's " + std::to_string(in.assembling->bytes) + " bytes";
  if (!error.empty()) {
    peer_errors.emplace_back(peer,
                             "protocol error from peer " + std::to_string(peer) + ": " + error);
    return nullptr;
  }
  return in.assembling;
}

bool ucx_transport::impl::room_to_receive(const recv_op& op) const {
  if (op.in->local)
    return local_receives_outstanding == 0 ||
           (local_receives_outstanding < max_local_receives_outstanding &&
            local_receive_bytes_outstanding + op.bytes <= max_local_receive_bytes_outstanding);
  const std::size_t at_least = op.in->loopback ? 1 : min_receives_outstanding;
  return receives_outstanding < max_receives_outstanding &&
         (receives_outstanding < at_least ||
          receive_bytes_outstanding < max_receive_bytes_outstanding);
}

void ucx_transport::impl::start_receive(recv_op* op, void* desc, std::byte* target) {
  op->counted = true;
  if (op->in->local) {
    ++local_receives_outstanding;
    local_receive_bytes_outstanding += op->bytes;
  } else {
    ++receives_outstanding;
    receive_bytes_outstanding += op->bytes;
  }
  ucp_request_param_t param{};
  param.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
  param.cb.recv_am = &recv_done;
  param.user_data = op;
  ucs_status_ptr_t r = ucp_am_recv_data_nbx(worker, desc, target, op->bytes, &param);
  if (r == nullptr || UCS_PTR_IS_ERR(r)) {
    op->status = r == nullptr ? UCS_OK : UCS_PTR_STATUS(r);
    completed_receives.push_back(op);
  } else {
    op->request = r;  // recv_done records the completion
  }
}

// Lands deferred messages in arrival order while rendezvous ones fit under the bounds.
unsigned ucx_transport::impl::land_deferred() {
  unsigned landed = 0;
  for (; !deferred.empty() && (!deferred.front()->rendezvous || room_to_receive(*deferred.front()));
       ++landed) {
    recv_op* op = deferred.front();
    deferred.pop_front();
    void* desc = std::exchange(op->desc, nullptr);
    const bool eager = !op->rendezvous;
    land(op, op->held.data(), desc);
    if (desc && eager) ucp_am_data_release(worker, desc);  // persistent eager data, copied
  }
  return landed;
}

void ucx_transport::impl::receive_completed(recv_op* op) {
  if (op->request) ucp_request_free(op->request);
  if (op->counted && op->in->local) {
    --local_receives_outstanding;
    local_receive_bytes_outstanding -= op->bytes;
  } else if (op->counted) {
    --receives_outstanding;
    receive_bytes_outstanding -= op->bytes;
  }
  const int peer = op->peer;
  const ucs_status_t status = op->status;
  frame_state* frame = op->frame;
  receives.give_back(op);
  if (status != UCS_OK && status != UCS_ERR_CANCELED)
    peer_errors.emplace_back(peer, std::string("receive failed: ") + ucs_status_string(status));
  if (!frame) return;
  frame->ok &= status == UCS_OK;
  if (--frame->pending > 0 || frame->posted < frame->bytes) return;
  frame_complete(frame);
}

// A frame whose bytes are all in its buffer: delivered now if every earlier frame of its peer
// was, with the later ones that waited for it; otherwise it waits for the earlier ones.
void ucx_transport::impl::frame_complete(frame_state* frame) {
  inbound& in = *frame->in;
  if (frame->index != in.next_delivery) {  // an earlier frame is still arriving
    in.complete.emplace(frame->index, frame);
    return;
  }
  deliver(frame);
  deliver_waiting(in);
}

// The same for a small frame, which takes a frame record only if it has to wait.
void ucx_transport::impl::small_complete(small_frame& f) {
  inbound& in = *f.in;
  if (f.index == in.next_delivery) {
    ++in.next_delivery;
    if (receive_fn) receive_fn(f.peer, std::move(f.buffer), f.bytes);
    return deliver_waiting(in);
  }
  frame_state* frame = frames.take();
  frame->index = f.index;
  frame->peer = f.peer;
  frame->in = &in;
  frame->buffer = std::move(f.buffer);
  frame->bytes = frame->posted = f.bytes;
  in.complete.emplace(frame->index, frame);
}

// Hands a frame that is next in its peer's order to the user and recycles its record.
void ucx_transport::impl::deliver(frame_state* frame) {
  ++frame->in->next_delivery;
  auto buffer = std::move(frame->buffer);
  const std::size_t bytes = frame->bytes;
  const int peer = frame->peer;
  const bool ok = frame->ok;
  frames.give_back(frame);
  if (ok && receive_fn) receive_fn(peer, std::move(buffer), bytes);
}

// Delivers the frames that waited for the ones just delivered (`complete` is ordered by index).
void ucx_transport::impl::deliver_waiting(inbound& in) {
  while (!in.complete.empty() && in.complete.begin()->first == in.next_delivery) {
    frame_state* frame = in.complete.begin()->second;
    in.complete.erase(in.complete.begin());
    deliver(frame);
  }
}

// Runs the user's callbacks for everything UCX completed. Returns how many events it handled.
unsigned ucx_transport::impl::dispatch() {
  unsigned events = 0;
  dispatching = true;
  while (has_completions()) {
    // By index: a receive callback that sends cannot add frames (only ucp_worker_progress
    // does), but the vector is read by index all the same.
    for (std::size_t i = 0; i < completed_small.size(); ++i, ++events)
      small_complete(completed_small[i]);
    completed_small.clear();
    for (; !completed_receives.empty(); ++events) {
      recv_op* op = completed_receives.front();
      completed_receives.pop_front();
      receive_completed(op);
    }
    for (; !completed_sends.empty(); ++events) {
      send_op* op = completed_sends.front();
      completed_sends.pop_front();
      send_completed(op);
    }
    for (; !peer_errors.empty(); ++events) {
      auto [peer, reason] = std::move(peer_errors.front());
      peer_errors.pop_front();
      report_peer_failure(peer, reason);
    }
  }
  dispatching = false;
  return events;
}

}  // namespace troupe::transport
