// UCX active-message transport for whole wire frames (see ucx_transport.hpp for the contract).
//
// Wire: a frame travels as one or more active messages (ucp_am_send_nbx, one id). Each message's
// AM header is an am_header (sender rank, message sequence, frame size, first-of-frame flag)
// followed by "inline" bytes; its AM data is one iov entry of zero_copy_threshold bytes or more,
// sent from the caller's memory, which UCX moves by zero-copy rendezvous (a cma get over shared
// memory) with the AM header riding in the rendezvous request. A run of shorter entries (the
// Cap'n Proto segment table and header segment) is copied into the AM header of the message that
// carries the next long entry, or of a message of its own; a run too long for an AM header
// (4 KiB, or UCX's max_am_header if smaller) goes as the data of a message of its own. So an
// activation frame is one message (it was two tag messages, header then payload, before).
// Receiving: the AM callback (inside ucp_worker_progress) reads the header, allocates the frame's
// aligned_buffer when the first message says how big the frame is, copies the inline bytes and any
// eager data to their offsets, and starts rendezvous receives straight into the buffer
// (ucp_am_recv_data_nbx): nobody copies a payload again. UCX delivers one endpoint's messages in
// order, which the sequence numbers check; frames complete out of order (a rendezvous part after a
// later eager frame) and are delivered in order.
// Small frames (all of it fits one AM header) take a short path: the sender offers the message
// for immediate completion from scratch memory (UCP_OP_ATTR_FLAG_FORCE_IMM_CMPL: UCX sends it by
// its short protocol or refuses without keeping the pointer), so `done` runs inside send() with
// no operation record; the receiver copies a frame that arrived whole in one eager message into
// its buffer inside the AM callback and queues it without a per-message record. Before, the
// records, their deques and the pool's lock cost ~1,450 instructions per one-way outside UCX
// (callgrind), which made our 8-byte latency ~0.07-0.15 us worse than ucx_perftest's.
// Receive buffers are reused once every holder dropped them (buffer_pool.hpp): a fresh 16 MiB
// buffer per frame faulted in ~3,000 pages per frame here, which cost about as much as moving the
// frame, and a fresh one for an 8-byte frame cost a fifth of a shared-memory round trip.
// At most max_receives_outstanding rendezvous receives (and max_receive_bytes_outstanding bytes,
// but always min_receives_outstanding receives) run at once; further rendezvous descriptors are
// kept (the callback returns UCS_INPROGRESS) and started from progress() as receives complete (a
// rendezvous message moves no payload until its receive starts). The small byte budget keeps the
// receive working set in cache: with 512 MiB, 32 frames of 1 MiB in flight each had their own
// buffer and the receiver ran at half of ucx_perftest's bandwidth (which receives into one
// buffer); with 4 MiB, at 0.91-0.99x. From a peer whose rendezvous is a shared-memory copy
// (cma, knem, xpmem: the receiving process copies), two receives run at a time: each completes
// in a following progress, the receiver drops the frame, and the next frame lands in one of the
// same two cache-warm pool buffers, as ucx_perftest's land in one. Started together, 32 frames of
// 64 KiB cycled through 32 buffers, and process_vm_readv into 32 buffers copied about 6-8% slower
// than into one (docs/transport.md). Two rather than one: the second copy is queued while the
// first runs, so one progress can finish both (64 KiB frames: 0.94x -> 0.97x of ucx_perftest in
// interleaved runs). Over the network, receives in flight overlap the peer's sending, so they
// keep the bounds above. Pool buffers of 2 MiB or more use transparent huge pages
// (aligned_buffer::make_large): 16 MiB frames went from about 0.83x to 0.85-0.94x. UCX callbacks
// only record completions; progress() runs the user's callbacks afterwards, outside UCX.
#include "topology/ucx_transport.hpp"

#include "topology/buffer_pool.hpp"

#include <poll.h>
#include <ucp/api/ucp.h>

#include <atomic>
#include <bit>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <deque>
#include <map>
#include <mutex>
#include <set>
#include <sstream>
#include <utility>

namespace troupe::topology {
namespace {

constexpr std::size_t zero_copy_threshold = 16 << 10;
constexpr std::size_t max_receives_outstanding = 64;
constexpr std::size_t min_receives_outstanding = 2;
constexpr std::size_t max_receive_bytes_outstanding = std::size_t{4} << 20;
constexpr std::size_t max_local_receives_outstanding = 2;  // from a shared-memory peer
constexpr auto close_deadline = std::chrono::seconds(2);
constexpr int rank_bits = 20;
constexpr unsigned frame_am_id = 1;
const std::string no_error;  // `done`'s reason on success
// Sent now by UCX's short protocol, or refused (UCS_ERR_NO_RESOURCE) without a request.
const ucp_request_param_t force_immediate = [] {
  ucp_request_param_t param{};
  param.op_attr_mask = UCP_OP_ATTR_FLAG_FORCE_IMM_CMPL;
  return param;
}();

// The start of every active message's header; the message's inline bytes follow it.
struct am_header {
  std::uint32_t rank = 0;         // the sender
  std::uint32_t sequence = 0;     // the sender's message number to this peer
  std::uint32_t frame_bytes = 0;  // the whole frame's size
  std::uint32_t first = 0;        // 1 on the first message of a frame
};
static_assert(sizeof(am_header) == 16);

[[noreturn]] void fail(const std::string& what, ucs_status_t status) {
  throw ucx_error("ucx_transport: " + what + ": " + ucs_status_string(status));
}

// A small frame's one message: its am_header, then every iov entry (the caller checked they fit).
void write_small_frame(std::byte* at, int rank, std::uint32_t sequence, std::size_t total,
                       const iov_list& iov) {
  const am_header h{static_cast<std::uint32_t>(rank), sequence, static_cast<std::uint32_t>(total),
                    1u};
  std::memcpy(at, &h, sizeof h);
  at += sizeof h;
  for (const auto& [data, length] : iov) {
    if (length > 0) std::memcpy(at, data, length);
    at += length;
  }
}

// Operation records reused from one operation to the next (no allocation per frame once warm).
template <class T>
struct recycler {
  std::vector<std::unique_ptr<T>> all;  // in use or spare; T::in_use tells which
  std::vector<T*> spare;
  T* take() {
    if (spare.empty()) spare.push_back(all.emplace_back(std::make_unique<T>()).get());
    T* t = spare.back();
    spare.pop_back();
    t->in_use = true;
    return t;
  }
  void give_back(T* t) {
    t->reset();
    spare.push_back(t);
  }
};

}  // namespace

struct ucx_transport::impl {
  struct inbound;
  struct send_op {
    impl* owner = nullptr;
    int peer = 0;
    std::vector<std::byte> staging;  // the messages' AM headers (am_header + inline bytes), runs
    send_callback done;
    std::vector<void*> requests;  // UCX requests of the messages still in flight at send()
    std::size_t completed = 0;
    bool in_use = false, posted = false;  // posted: every message was handed to UCX
    ucs_status_t status = UCS_OK;         // first failure of a message
    void reset() {
      staging.clear();
      done = nullptr;
      requests.clear();
      completed = 0;
      in_use = posted = false;
      status = UCS_OK;
    }
  };
  struct frame_state {        // recycled once delivered (or dropped)
    std::uint64_t index = 0;  // per-peer frame number, in send order
    int peer = 0;
    inbound* in = nullptr;
    std::shared_ptr<messages::aligned_buffer> buffer;
    std::size_t bytes = 0;    // the frame's size (the buffer may be larger)
    std::size_t posted = 0;   // bytes of the messages that arrived so far
    std::size_t pending = 0;  // messages whose bytes are not all in the buffer yet
    bool ok = true, in_use = false;
    void reset() { *this = frame_state{}; }
  };
  struct small_frame {  // a frame that arrived whole in one eager message, in its buffer already
    inbound* in = nullptr;
    int peer = 0;
    std::uint64_t index = 0;
    std::shared_ptr<messages::aligned_buffer> buffer;
    std::size_t bytes = 0;
  };
  struct recv_op {  // one arrived message of a frame
    impl* owner = nullptr;
    int peer = 0;
    inbound* in = nullptr;
    frame_state* frame = nullptr;
    std::size_t offset = 0;        // of its bytes (inline bytes, then data) in the frame
    std::size_t inline_bytes = 0;  // from its AM header
    std::size_t bytes = 0;         // AM data bytes
    bool rendezvous = false;
    // Deferred: the inline bytes and the data UCX keeps (a rendezvous descriptor or persistent
    // eager data), or, for eager data UCX does not keep, a copy of it after the inline bytes.
    std::vector<std::byte> held;
    void* desc = nullptr;
    bool counted = false;  // a started rendezvous receive, counted in the outstanding ones
    void* request = nullptr;
    bool in_use = false;
    ucs_status_t status = UCS_INPROGRESS;
    void reset() {
      in = nullptr;
      frame = nullptr;
      offset = inline_bytes = bytes = 0;
      rendezvous = counted = false;
      held.clear();
      desc = nullptr;
      request = nullptr;
      in_use = false;
      status = UCS_INPROGRESS;
    }
  };
  struct am_message {                             // send()'s plan of one active message
    std::size_t header_at = 0, header_bytes = 0;  // in the send_op's staging
    const void* data = nullptr;
    std::size_t data_bytes = 0;
  };
  struct peer_state {
    impl* owner = nullptr;
    int peer = 0;
    ucp_ep_h ep = nullptr;
    std::uint32_t next_send = 0;
    bool error_handling = false;  // UCP_ERR_HANDLING_MODE_PEER on this endpoint
    std::string failure;          // non-empty once the peer failed
    // Small frames are first offered to UCX for immediate completion, from scratch memory, which
    // only UCX's short protocol gives (one FIFO element over shared memory: ~100 bytes). A size
    // refused while no larger one ever went at once is over that limit, and the peer's frames of
    // that size or more skip the offer; a refusal at or below a size that went is a full queue.
    std::size_t immediate_max = SIZE_MAX;  // message bytes (am_header + frame) offered at most
    std::size_t immediate_seen = 0;        // the largest message that completed at once
  };
  struct inbound {  // receiving side of one peer
    std::uint32_t next_sequence = 0;
    std::uint64_t next_frame = 0, next_delivery = 0;
    frame_state* assembling = nullptr;               // messages still to arrive
    std::map<std::uint64_t, frame_state*> complete;  // waiting for an earlier one
    bool local = false;  // the peer's rendezvous lane copies through shared memory (cma, ...)
  };

  int rank = 0;
  ucx_options options;
  ucp_context_h context = nullptr;
  ucp_worker_h worker = nullptr;
  int event_fd = -1;
  buffer_pool pool;
  // The buffer the next small frame lands in, taken ahead by progress() (outside the time from a
  // frame's arrival to its delivery), in the size class of the last small frame.
  std::shared_ptr<messages::aligned_buffer> spare_small;
  std::size_t last_small_bytes = 0;
  std::map<int, peer_state> peers;  // node-based: err_handler args point into it
  int last_peer = -1;               // the peer connected() found last, and its state
  peer_state* last_peer_state = nullptr;
  std::map<int, inbound> inbounds;  // node-based: frames and the cache below point into it
  int last_inbound_peer = -1;       // the peer arrived() looked up last, and its state
  inbound* last_inbound = nullptr;
  recycler<send_op> sends;
  recycler<recv_op> receives;
  recycler<frame_state> frames;
  std::vector<am_message> messages;  // send()'s scratch
  std::vector<std::byte> immediate;  // a small frame's message offered for immediate completion
  std::size_t header_room = 0;       // am_header + inline bytes at most (max_am_header, 4 KiB)
  std::deque<send_op*> completed_sends;
  std::deque<recv_op*> completed_receives;
  std::vector<small_frame> completed_small;
  std::deque<recv_op*> deferred;  // rendezvous messages waiting for room to start receiving
  std::deque<std::pair<int, std::string>> peer_errors;
  std::size_t receives_outstanding = 0, receive_bytes_outstanding = 0;
  std::size_t local_receives_outstanding = 0;
  receive_callback receive_fn;
  peer_error_callback peer_error_fn;
  bool dispatching = false, closing = false;
  std::atomic<bool> woken{false};  // wake() was called (other threads)

  static void send_done(void*, ucs_status_t status, void* user_data) {
    auto* op = static_cast<send_op*>(user_data);
    if (status != UCS_OK && op->status == UCS_OK) op->status = status;
    if (++op->completed == op->requests.size() && op->posted)
      op->owner->completed_sends.push_back(op);
  }
  static void recv_done(void* request, ucs_status_t status, std::size_t, void* user_data) {
    auto* op = static_cast<recv_op*>(user_data);
    op->request = request;
    op->status = status;
    op->owner->completed_receives.push_back(op);
  }
  static void endpoint_failed(void* arg, ucp_ep_h, ucs_status_t status) {
    auto* p = static_cast<peer_state*>(arg);
    p->owner->peer_errors.emplace_back(p->peer,
                                       std::string("endpoint error: ") + ucs_status_string(status));
  }

  // The transports/devices of an endpoint's lanes, e.g. "posix/memory cma/memory", from
  // ucp_ep_print_info.
  static std::string lanes(ucp_ep_h ep) {
    char* text = nullptr;
    std::size_t length = 0;
    FILE* stream = ::open_memstream(&text, &length);
    if (stream == nullptr) throw ucx_error("ucx_transport: open_memstream failed");
    ucp_ep_print_info(ep, stream);
    std::fclose(stream);
    std::string info(text, length);
    std::free(text);
    // Lane lines read "#  lane[0]:  3:posix/memory.0 md[2] -> ...": keep "posix/memory".
    std::set<std::string> seen;
    std::string out;
    std::istringstream lines(info);
    for (std::string line; std::getline(lines, line);) {
      const auto lane = line.find("lane[");
      if (lane == std::string::npos) continue;
      const auto colon = line.find(':', line.find("]:", lane) + 2);
      if (colon == std::string::npos) continue;
      std::string word = line.substr(colon + 1, line.find_first_of(" \t", colon) - colon - 1);
      if (const auto dot = word.rfind('.'); dot != std::string::npos && word.find('/') < dot)
        word.erase(dot);
      if (seen.insert(word).second) out += (out.empty() ? "" : " ") + word;
    }
    return out;
  }

  peer_state& connected(int peer, const char* what) {
    return peer == last_peer ? *last_peer_state : look_up(peer, what);
  }
  [[gnu::noinline]] peer_state& look_up(int peer, const char* what) {
    auto it = peers.find(peer);
    if (it == peers.end())
      throw ucx_error("ucx_transport (rank " + std::to_string(rank) + "): " + what + " peer " +
                      std::to_string(peer) + ", which is not connected");
    last_peer = peer;
    last_peer_state = &it->second;
    return it->second;
  }

  // An active message (inside ucp_worker_progress). A small frame (the whole frame in one eager
  // message: control messages, latency probes) is copied into its buffer here and delivered in
  // order from progress(), without a per-message record; any other message goes to arrived().
  static ucs_status_t am_arrived(void* arg, const void* header, std::size_t header_length,
                                 void* data, std::size_t length, const ucp_am_recv_param_t* param) {
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

  [[gnu::noinline]] void find_inbound(int peer) {
    last_inbound = &inbounds[peer];
    last_inbound_peer = peer;
  }

  // A message of a frame of several messages, or of one too long to be small. It lands (land())
  // now unless earlier messages wait, or it is a rendezvous one past the outstanding bounds; then
  // it waits in `deferred`. A frame's buffer is taken when its first message lands, so frames
  // waiting in UCX hold no buffer (32 frames of 1 MiB in flight each with their own buffer ran at
  // about half the bandwidth of 4 at a time: the receive working set fell out of cache).
  [[gnu::noinline]] ucs_status_t arrived(const am_header& h, inbound& in,
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
  void land(recv_op* op, const std::byte* inline_at, void* data) {
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
  frame_state* frame_of(inbound& in, int peer, const am_header& h, std::size_t bytes) {
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

  bool room_to_receive(const recv_op& op) const {
    if (op.in->local) return local_receives_outstanding < max_local_receives_outstanding;
    return receives_outstanding < max_receives_outstanding &&
           (receives_outstanding < min_receives_outstanding ||
            receive_bytes_outstanding < max_receive_bytes_outstanding);
  }

  void start_receive(recv_op* op, void* desc, std::byte* target) {
    op->counted = true;
    if (op->in->local) {
      ++local_receives_outstanding;
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
  unsigned land_deferred() {
    unsigned landed = 0;
    for (;
         !deferred.empty() && (!deferred.front()->rendezvous || room_to_receive(*deferred.front()));
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

  void report_peer_failure(int peer, const std::string& reason) {
    auto it = peers.find(peer);
    if (it != peers.end()) {
      if (!it->second.failure.empty()) return;
      it->second.failure = reason;
    }
    if (peer_error_fn) peer_error_fn(peer, reason);
  }

  void receive_completed(recv_op* op) {
    if (op->request) ucp_request_free(op->request);
    if (op->counted && op->in->local) {
      --local_receives_outstanding;
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
  void frame_complete(frame_state* frame) {
    inbound& in = *frame->in;
    if (frame->index != in.next_delivery) {  // an earlier frame is still arriving
      in.complete.emplace(frame->index, frame);
      return;
    }
    deliver(frame);
    deliver_waiting(in);
  }

  // The same for a small frame, which takes a frame record only if it has to wait.
  void small_complete(small_frame& f) {
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
  void deliver(frame_state* frame) {
    ++frame->in->next_delivery;
    auto buffer = std::move(frame->buffer);
    const std::size_t bytes = frame->bytes;
    const int peer = frame->peer;
    const bool ok = frame->ok;
    frames.give_back(frame);
    if (ok && receive_fn) receive_fn(peer, std::move(buffer), bytes);
  }

  // Delivers the frames that waited for the ones just delivered (`complete` is ordered by index).
  void deliver_waiting(inbound& in) {
    while (!in.complete.empty() && in.complete.begin()->first == in.next_delivery) {
      frame_state* frame = in.complete.begin()->second;
      in.complete.erase(in.complete.begin());
      deliver(frame);
    }
  }

  void send_completed(send_op* op) {
    for (void* r : op->requests) ucp_request_free(r);
    const int peer = op->peer;
    const ucs_status_t status = op->status;
    auto done = std::move(op->done);
    sends.give_back(op);  // before `done`, which may send again
    if (status == UCS_OK) return done(true, {});
    const std::string reason =
        "send to peer " + std::to_string(peer) + " failed: " + ucs_status_string(status);
    done(false, reason);
    peer_errors.emplace_back(peer, reason);
  }

  // send() of a frame that is not small, or that UCX refused to send at once: its messages
  // planned into a recycled record, which send_done() completes.
  [[gnu::noinline]] void send_with_record(peer_state& p, int peer, const iov_list& iov,
                                          send_callback& done, std::size_t total,
                                          std::size_t staged) {
    send_op* op = sends.take();
    op->owner = this;
    op->peer = peer;
    ucp_request_param_t param{};
    param.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
    param.cb.send = &send_done;
    param.user_data = op;
    op->done = std::move(done);
    // Room for every message's header and every copied run; never reallocated below.
    op->staging.resize((iov.size() + 1) * sizeof(am_header) + staged);
    std::byte* const base = op->staging.data();
    std::size_t used = 0;
    // The messages: each long entry by reference as AM data, the run of short entries before it
    // copied inline into its AM header. A run with no long entry after it is inline in a message
    // of its own; one too long for an AM header goes as that message's data (in place when it is
    // a single entry).
    messages.clear();
    std::size_t run_first = 0, run_end = 0, run_entries = 0, run_bytes = 0;
    auto copy_run = [&] {
      for (std::size_t k = run_first; k < run_end; ++k)
        if (iov[k].second > 0 && iov[k].second < zero_copy_threshold) {
          std::memcpy(base + used, iov[k].first, iov[k].second);
          used += iov[k].second;
        }
    };
    auto add_message = [&](bool inline_run) -> am_message& {
      auto& m = messages.emplace_back();
      m.header_at = used;
      used += sizeof(am_header);
      if (inline_run) copy_run();
      m.header_bytes = used - m.header_at;
      return m;
    };
    auto flush = [&](const void* data, std::size_t bytes) {  // the run, then the long entry if any
      if (run_entries > 0 && sizeof(am_header) + run_bytes > header_room) {
        auto& m = add_message(false);
        m.data = run_entries == 1 ? iov[run_first].first : base + used;
        m.data_bytes = run_bytes;
        if (run_entries > 1) copy_run();
        run_entries = run_bytes = 0;
      }
      if (run_entries == 0 && data == nullptr) return;
      auto& m = add_message(run_entries > 0);
      m.data = data;
      m.data_bytes = bytes;
      run_entries = run_bytes = 0;
    };
    for (std::size_t k = 0; k < iov.size(); ++k) {
      if (iov[k].second >= zero_copy_threshold) {
        flush(iov[k].first, iov[k].second);
      } else if (iov[k].second > 0) {
        if (run_entries++ == 0) run_first = k;
        run_end = k + 1;
        run_bytes += iov[k].second;
      }
    }
    flush(nullptr, 0);
    if (messages.empty()) add_message(false);  // an empty frame is one empty message
    for (std::size_t i = 0; i < messages.size(); ++i) {
      const auto& m = messages[i];
      const am_header h{static_cast<std::uint32_t>(rank), p.next_send++,
                        static_cast<std::uint32_t>(total), i == 0 ? 1u : 0u};
      std::memcpy(base + m.header_at, &h, sizeof h);
      ucs_status_ptr_t r = ucp_am_send_nbx(p.ep, frame_am_id, base + m.header_at, m.header_bytes,
                                           m.data, m.data_bytes, &param);
      if (UCS_PTR_IS_ERR(r)) {
        if (op->status == UCS_OK) op->status = UCS_PTR_STATUS(r);
      } else if (r != nullptr) {
        op->requests.push_back(r);
      }
    }
    op->posted = true;
    if (op->completed == op->requests.size()) send_completed(op);  // all done at once
  }

  bool has_completions() const {
    return !completed_small.empty() || !completed_sends.empty() || !completed_receives.empty() ||
           !peer_errors.empty();
  }

  // Runs the user's callbacks for everything UCX completed. Returns how many events it handled.
  unsigned dispatch() {
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

  // Closes every endpoint (flush; force once the peer failed in PEER mode), cancels receives,
  // progresses until all close or the deadline passes, then releases every request UCX still
  // holds (no callback runs for a released request), so the worker can be destroyed.
  void shut_down() {
    closing = true;  // messages arriving from now on are dropped
    for (recv_op* op : deferred) {
      if (op->desc) ucp_am_data_release(worker, op->desc);
      receives.give_back(op);
    }
    deferred.clear();
    for (auto& op : receives.all)
      if (op->in_use && op->request && op->status == UCS_INPROGRESS)
        ucp_request_cancel(worker, op->request);
    std::vector<void*> closing;
    for (auto& [peer, p] : peers) {
      ucp_request_param_t param{};
      param.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
      param.flags = p.error_handling && !p.failure.empty() ? UCP_EP_CLOSE_FLAG_FORCE : 0;
      ucs_status_ptr_t r = ucp_ep_close_nbx(p.ep, &param);
      if (r != nullptr && !UCS_PTR_IS_ERR(r)) closing.push_back(r);
    }
    const auto deadline = std::chrono::steady_clock::now() + close_deadline;
    while (std::chrono::steady_clock::now() < deadline) {
      ucp_worker_progress(worker);
      std::erase_if(closing, [](void* r) {
        if (ucp_request_check_status(r) == UCS_INPROGRESS) return false;
        ucp_request_free(r);
        return true;
      });
      bool receiving = false;
      for (auto& op : receives.all) receiving |= op->in_use && op->status == UCS_INPROGRESS;
      if (closing.empty() && !receiving) break;
    }
    for (void* r : closing) ucp_request_free(r);
    for (auto& op : receives.all)
      if (op->in_use && op->request) ucp_request_free(std::exchange(op->request, nullptr));
    for (auto& op : sends.all) {
      if (!op->in_use) continue;
      for (void* r : op->requests) ucp_request_free(r);
      if (op->completed < op->requests.size() && op->status == UCS_OK)
        op->status = UCS_INPROGRESS;  // never finished
    }
  }
};

ucx_transport::ucx_transport(int rank, const ucx_options& options)
    : impl_(std::make_unique<impl>()) {
  if (rank < 0 || rank >= (1 << rank_bits))
    throw ucx_error("ucx_transport: rank " + std::to_string(rank) + " is outside [0, " +
                    std::to_string(1 << rank_bits) + ")");
  impl_->rank = rank;
  impl_->options = options;
  ucp_config_t* config = nullptr;
  if (auto s = ucp_config_read(nullptr, nullptr, &config); s != UCS_OK) fail("ucp_config_read", s);
  auto modify = [&](const char* key, const std::string& value) {
    if (value.empty()) return;
    if (auto s = ucp_config_modify(config, key, value.c_str()); s != UCS_OK) {
      ucp_config_release(config);
      fail(std::string("UCX_") + key + "='" + value + "' rejected", s);
    }
  };
  modify("TLS", options.transports);
  modify("NET_DEVICES", options.net_devices);
  ucp_params_t params{};
  params.field_mask = UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_MT_WORKERS_SHARED;
  params.features = UCP_FEATURE_AM | UCP_FEATURE_WAKEUP;
  params.mt_workers_shared = 0;
  const ucs_status_t s = ucp_init(&params, config, &impl_->context);
  ucp_config_release(config);
  if (s != UCS_OK) fail("ucp_init with UCX_TLS='" + options.transports + "'", s);
  ucp_worker_params_t wp{};
  wp.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
  wp.thread_mode = UCS_THREAD_MODE_SINGLE;
  if (auto ws = ucp_worker_create(impl_->context, &wp, &impl_->worker); ws != UCS_OK) {
    ucp_cleanup(impl_->context);
    fail("ucp_worker_create", ws);
  }
  auto setup = [&](const char* what, ucs_status_t status) {
    if (status == UCS_OK) return;
    ucp_worker_destroy(impl_->worker);
    ucp_cleanup(impl_->context);
    fail(what, status);
  };
  setup("ucp_worker_get_efd", ucp_worker_get_efd(impl_->worker, &impl_->event_fd));
  ucp_worker_attr_t attr{};
  attr.field_mask = UCP_WORKER_ATTR_FIELD_MAX_AM_HEADER;
  setup("ucp_worker_query", ucp_worker_query(impl_->worker, &attr));
  impl_->header_room = std::min<std::size_t>(attr.max_am_header, 4096);
  impl_->immediate.resize(impl_->header_room);
  if (impl_->header_room < sizeof(am_header)) setup("max_am_header", UCS_ERR_UNSUPPORTED);
  ucp_am_handler_param_t handler{};
  handler.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_FLAGS |
                       UCP_AM_HANDLER_PARAM_FIELD_CB | UCP_AM_HANDLER_PARAM_FIELD_ARG;
  handler.id = frame_am_id;
  handler.flags = UCP_AM_FLAG_WHOLE_MSG;
  handler.cb = &impl::am_arrived;
  handler.arg = impl_.get();
  setup("ucp_worker_set_am_recv_handler", ucp_worker_set_am_recv_handler(impl_->worker, &handler));
}

ucx_transport::~ucx_transport() {
  impl_->shut_down();
  // Sends whose parts all completed keep their status; the others fail.
  ucp_worker_destroy(impl_->worker);
  ucp_cleanup(impl_->context);
  for (auto& op : impl_->sends.all) {
    if (!op->in_use) continue;
    const std::string peer = std::to_string(op->peer);
    if (op->status == UCS_OK)
      op->done(true, {});
    else if (op->status == UCS_INPROGRESS)
      op->done(false, "ucx_transport closed before the send to peer " + peer + " completed");
    else
      op->done(false, "send to peer " + peer + " failed: " + ucs_status_string(op->status));
  }
}

int ucx_transport::rank() const { return impl_->rank; }

std::vector<std::uint8_t> ucx_transport::address() const {
  ucp_address_t* address = nullptr;
  std::size_t length = 0;
  if (auto s = ucp_worker_get_address(impl_->worker, &address, &length); s != UCS_OK)
    fail("ucp_worker_get_address", s);
  const auto* bytes = reinterpret_cast<const std::uint8_t*>(address);
  std::vector<std::uint8_t> blob(bytes, bytes + length);
  ucp_worker_release_address(impl_->worker, address);
  return blob;
}

void ucx_transport::connect(int peer, const std::vector<std::uint8_t>& address) {
  connect(peer, address, impl_->options.peer_error_handling);
}

void ucx_transport::connect(int peer, const std::vector<std::uint8_t>& address,
                            bool peer_error_handling) {
  if (impl_->peers.count(peer))
    throw ucx_error("ucx_transport: peer " + std::to_string(peer) + " is already connected");
  if (address.empty())
    throw ucx_error("ucx_transport: empty worker address for peer " + std::to_string(peer));
  auto& p = impl_->peers[peer];
  p.owner = impl_.get();
  p.peer = peer;
  p.error_handling = peer_error_handling;
  ucp_ep_params_t ep{};
  ep.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE;
  ep.address = reinterpret_cast<const ucp_address_t*>(address.data());
  ep.err_mode = peer_error_handling ? UCP_ERR_HANDLING_MODE_PEER : UCP_ERR_HANDLING_MODE_NONE;
  // The callback goes on every endpoint, even one without peer error handling: a transport
  // error UCX does detect there (a cma read from a peer that has died mid-fetch) is fatal to
  // this process in UCX 1.13 unless the endpoint has an error callback (ucp_ep_set_failed).
  ep.field_mask |= UCP_EP_PARAM_FIELD_ERR_HANDLER;
  ep.err_handler.cb = &impl::endpoint_failed;
  ep.err_handler.arg = &p;
  if (auto s = ucp_ep_create(impl_->worker, &ep, &p.ep); s != UCS_OK) {
    impl_->peers.erase(peer);
    fail("ucp_ep_create to peer " + std::to_string(peer), s);
  }
  std::istringstream lanes(impl::lanes(p.ep));
  for (std::string lane; lanes >> lane;) {
    const std::string tl = lane.substr(0, lane.find('/'));
    impl_->inbounds[peer].local |= tl == "cma" || tl == "knem" || tl == "xpmem";
  }
}

void ucx_transport::send(int peer, const iov_list& iov, send_callback done) {
  auto& p = impl_->connected(peer, "send to");
  if (!p.failure.empty())
    return done(false, "peer " + std::to_string(peer) + " failed earlier: " + p.failure);
  std::size_t total = 0, staged = 0;
  for (const auto& [data, length] : iov) {
    total += length;
    if (length < zero_copy_threshold) staged += length;
  }
  if (total > 0xffffffffu)
    return done(false, "frame of " + std::to_string(total) + " bytes to peer " +
                           std::to_string(peer) + " exceeds the transport's 4 GiB limit");
  const std::size_t message_bytes = sizeof(am_header) + total;
  if (staged == total && message_bytes <= p.immediate_max && message_bytes <= impl_->header_room) {
    // UCX either sends it now (then `done` runs here, with no operation record and no request)
    // or refuses (UCS_ERR_NO_RESOURCE) without keeping a pointer to `immediate`.
    write_small_frame(impl_->immediate.data(), impl_->rank, p.next_send, total, iov);
    // As the message's data, not its AM header: UCX then copies two pieces into the FIFO
    // element, not three (arrived() reads the header from the data).
    ucs_status_ptr_t r = ucp_am_send_nbx(p.ep, frame_am_id, nullptr, 0, impl_->immediate.data(),
                                         message_bytes, &force_immediate);
    if (r == nullptr) {
      ++p.next_send;
      p.immediate_seen = std::max(p.immediate_seen, message_bytes);
      return done(true, no_error);
    }
    if (UCS_PTR_STATUS(r) == UCS_ERR_NO_RESOURCE && message_bytes > p.immediate_seen)
      p.immediate_max = message_bytes - 1;
    // Refused or failed: the path below sends it with a record (and reports a failure).
  }
  impl_->send_with_record(p, peer, iov, done, total, staged);
}

void ucx_transport::on_receive(receive_callback fn) { impl_->receive_fn = std::move(fn); }

void ucx_transport::on_peer_error(peer_error_callback fn) { impl_->peer_error_fn = std::move(fn); }

unsigned ucx_transport::progress() {
  if (impl_->dispatching)
    throw ucx_error("ucx_transport: progress() called from one of its own callbacks");
  if (!impl_->spare_small && impl_->last_small_bytes > 0)
    impl_->spare_small = impl_->pool.take(impl_->last_small_bytes);
  unsigned events = ucp_worker_progress(impl_->worker);
  // An idle poll (most calls of a busy-polling loop) ends here: dispatching costs as many
  // instructions as UCX's own idle poll.
  if (events == 0 && !impl_->has_completions()) return 0;
  events += impl_->dispatch();
  // Completed receives freed room under the bounds: start the rendezvous receives left waiting.
  if (events > 0 && !impl_->deferred.empty()) {
    events += impl_->land_deferred();
    if (impl_->has_completions()) events += impl_->dispatch();
  }
  return events;
}

void ucx_transport::wait(std::chrono::microseconds timeout) {
  auto ready = [this] { return impl_->has_completions(); };
  if (ready()) return;
  if (timeout.count() < 0) timeout = std::chrono::microseconds(0);
  // Spin first: ucp_worker_progress only records completions here (the callbacks that run are
  // UCX's, not the user's); the caller's next progress() dispatches them.
  const auto spin = std::min(impl_->options.poll_before_sleep, timeout);
  if (spin.count() > 0) {
    const auto until = std::chrono::steady_clock::now() + spin;
    do {
      if (ucp_worker_progress(impl_->worker) > 0 || ready() ||
          impl_->woken.exchange(false, std::memory_order_acquire))
        return;
    } while (std::chrono::steady_clock::now() < until);
    timeout -= spin;
  }
  const ucs_status_t s = ucp_worker_arm(impl_->worker);
  if (s == UCS_ERR_BUSY) return;
  if (s != UCS_OK) fail("ucp_worker_arm", s);
  pollfd fd{impl_->event_fd, POLLIN, 0};
  const timespec ts{static_cast<time_t>(timeout.count() / 1000000),
                    static_cast<long>(timeout.count() % 1000000) * 1000};
  if (::ppoll(&fd, 1, &ts, nullptr) < 0 && errno != EINTR)
    throw ucx_error(std::string("ucx_transport: ppoll on the UCX event fd: ") +
                    std::strerror(errno));
}

void ucx_transport::wake() {
  impl_->woken.store(true, std::memory_order_release);  // seen by a wait() that is still polling
  ucp_worker_signal(impl_->worker);
}

std::string ucx_transport::transport_info(int peer) const {
  return impl::lanes(impl_->connected(peer, "transport_info for").ep);
}

}  // namespace troupe::topology
