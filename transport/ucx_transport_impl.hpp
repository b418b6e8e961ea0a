// The UCX transport's inside, shared by its three files: ucx_transport.cpp (context, worker,
// endpoints, progress, wait, shutdown), ucx_receive.cpp (the receiving side) and ucx_send.cpp
// (the sending side). Private to them: it includes UCX's headers, which the gateway's
// translation units never see (ucx_transport.hpp is the contract). docs/transport.md describes
// the design and its benchmark.
//
// Wire: a frame travels as one or more active messages (ucp_am_send_nbx, one id). Each message's
// AM header is an am_header (sender rank, message sequence, frame size, first-of-frame flag)
// followed by "inline" bytes; its AM data is one iov entry of zero_copy_threshold bytes or more,
// sent from the caller's memory, which UCX moves by zero-copy rendezvous (a cma get over shared
// memory) with the AM header riding in the rendezvous request. A run of shorter entries (the
// Cap'n Proto segment table and header segment) is copied into the AM header of the message that
// carries the next long entry, or of a message of its own; a run too long for an AM header
// (4 KiB, or UCX's max_am_header if smaller) goes as the data of a message of its own. So an
// activation frame is one message.
// Receiving: the AM callback (inside ucp_worker_progress) reads the header, allocates the frame's
// aligned_buffer when the first message says how big the frame is, copies the inline bytes and any
// eager data to their offsets, and starts rendezvous receives straight into the buffer
// (ucp_am_recv_data_nbx): nobody copies a payload again. UCX delivers one endpoint's messages in
// order, which the sequence numbers check; frames complete out of order (a rendezvous part after a
// later eager frame) and are delivered in order.
// Small frames (all of it fits one AM header) take a short path: the sender offers the message
// for immediate completion from scratch memory (UCP_OP_ATTR_FLAG_FORCE_IMM_CMPL: UCX sends it by
// its short protocol or refuses without keeping the pointer), so `done` runs inside send() with
// no operation record (the message is the am_header and the frame as AM data, which UCX copies
// into its FIFO element in two pieces rather than three); the receiver copies a frame that
// arrived whole in one eager message into a buffer taken ahead (by progress(), before it polls)
// inside the AM callback and queues it without a per-message record. So the path from a frame's
// arrival to the next frame's departure takes no lock and no operation record, and once warm
// allocates nothing.
// Receive buffers are reused once every holder dropped them (buffer_pool.hpp): a fresh 16 MiB
// buffer per frame faulted in ~3,000 pages per frame here, which cost about as much as moving the
// frame, and a fresh one for an 8-byte frame cost a fifth of a shared-memory round trip.
// At most max_receives_outstanding rendezvous receives (and max_receive_bytes_outstanding bytes,
// but always min_receives_outstanding receives) run at once; further rendezvous descriptors are
// kept (the callback returns UCS_INPROGRESS) and started from progress() as receives complete (a
// rendezvous message moves no payload until its receive starts). The small byte budget keeps the
// receive working set in cache: with 512 MiB, 32 frames of 1 MiB in flight each had their own
// buffer and the receiver ran at half of ucx_perftest's bandwidth (which receives into one
// buffer). From a peer whose rendezvous is a shared-memory copy (cma, knem, xpmem: the receiving
// process copies), at most two receives run at a time: each completes in a following progress,
// the receiver drops the frame, and the next frame lands in one of the same two cache-warm pool
// buffers, as ucx_perftest's land in one (process_vm_readv into 32 buffers in turn copied about
// 6-8% slower than into one). Two rather than one: the second copy is queued while the first
// runs, so one progress can finish both. The second starts only while the two stay within
// max_local_receive_bytes_outstanding together, so frames over 512 KiB land one at a time, in
// one buffer: with two 1 MiB receive buffers and the sender's 1 MiB source, the working set
// overflows a 2 MiB L2 (on a 16-core Xeon, 1 MiB frames ran at 0.80-0.88x of ucx_perftest with
// two at a time and 0.96-0.98x with one). Over the network, receives in flight overlap the peer's
// sending, so they keep the bounds above, except that a network peer reached over the loopback
// device (so on this host) gets one receive at a time, not two, once a frame exceeds the byte
// budget: sender and receiver then share the last-level cache, which a second 16 MiB receive
// buffer overflows. Between hosts a second receive saves a round trip per frame and shares no
// cache with the sender. The counts are per process: all shared-memory peers share one pair of
// bounds, all network peers the other. Pool buffers of 2 MiB or more use transparent huge pages
// (aligned_buffer::make_large). UCX callbacks only record completions; progress() runs the user's
// callbacks afterwards, outside UCX.
#pragma once

#include <ucp/api/ucp.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "transport/buffer_pool.hpp"
#include "transport/ucx_transport.hpp"

namespace troupe::transport {
namespace ucx_detail {

// An iov entry this long or longer is the data of a message of its own (zero-copy rendezvous).
constexpr std::size_t zero_copy_threshold = 16 << 10;
constexpr unsigned frame_am_id = 1;

// The start of every active message's header; the message's inline bytes follow it.
struct am_header {
  std::uint32_t rank = 0;         // the sender
  std::uint32_t sequence = 0;     // the sender's message number to this peer
  std::uint32_t frame_bytes = 0;  // the whole frame's size
  std::uint32_t first = 0;        // 1 on the first message of a frame
};
static_assert(sizeof(am_header) == 16);

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

}  // namespace ucx_detail

struct ucx_transport::impl {
  using am_header = ucx_detail::am_header;
  template <class T>
  using recycler = ucx_detail::recycler<T>;

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
    bool local = false;     // the peer's rendezvous lane copies through shared memory (cma, ...)
    bool loopback = false;  // a network lane on the loopback device: the peer shares our caches
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
  std::size_t local_receives_outstanding = 0, local_receive_bytes_outstanding = 0;
  receive_callback receive_fn;
  peer_error_callback peer_error_fn;
  bool dispatching = false, closing = false;
  std::atomic<bool> woken{false};  // wake() was called (other threads)

  // Receiving (ucx_receive.cpp). am_arrived is UCX's AM callback; recv_done a rendezvous
  // receive's.
  static ucs_status_t am_arrived(void* arg, const void* header, std::size_t header_length,
                                 void* data, std::size_t length, const ucp_am_recv_param_t* param);
  static void recv_done(void* request, ucs_status_t status, std::size_t, void* user_data);
  [[gnu::noinline]] void find_inbound(int peer);
  [[gnu::noinline]] ucs_status_t arrived(const am_header& h, inbound& in,
                                         const std::byte* inline_at, std::size_t inline_bytes,
                                         void* data, std::size_t length, bool rendezvous,
                                         bool persistent);
  void land(recv_op* op, const std::byte* inline_at, void* data);
  frame_state* frame_of(inbound& in, int peer, const am_header& h, std::size_t bytes);
  bool room_to_receive(const recv_op& op) const;
  void start_receive(recv_op* op, void* desc, std::byte* target);
  unsigned land_deferred();
  void receive_completed(recv_op* op);
  void frame_complete(frame_state* frame);
  void small_complete(small_frame& f);
  void deliver(frame_state* frame);
  void deliver_waiting(inbound& in);
  unsigned dispatch();

  // Sending (ucx_send.cpp; send() itself is there too). send_done is UCX's callback.
  static void send_done(void*, ucs_status_t status, void* user_data);
  [[gnu::noinline]] void send_with_record(peer_state& p, int peer, const iov_list& iov,
                                          send_callback& done, std::size_t total,
                                          std::size_t staged);
  void send_completed(send_op* op);

  // Endpoints, failures and shutdown (ucx_transport.cpp).
  static void endpoint_failed(void* arg, ucp_ep_h, ucs_status_t status);
  static std::string lanes(ucp_ep_h ep);
  [[gnu::noinline]] peer_state& look_up(int peer, const char* what);
  void report_peer_failure(int peer, const std::string& reason);
  void shut_down();

  peer_state& connected(int peer, const char* what) {
    return peer == last_peer ? *last_peer_state : look_up(peer, what);
  }
  bool has_completions() const {
    return !completed_small.empty() || !completed_sends.empty() || !completed_receives.empty() ||
           !peer_errors.empty();
  }
};

}  // namespace troupe::transport
