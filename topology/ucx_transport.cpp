// UCX tag-matching transport for whole wire frames (see ucx_transport.hpp for the contract).
//
// Wire: a frame travels as one or more contiguous tag messages ("parts"). Every iov entry of
// zero_copy_threshold bytes or more is its own part, sent from the caller's memory, so UCX moves
// it by zero-copy rendezvous (a cma get over shared memory); a run of shorter entries is copied
// into one staging part (UCX copies such sizes for an eager send anyway), or sent in place when
// the run is a single entry. Not one UCP_DATATYPE_IOV message: UCX 1.13 has no zero-copy
// rendezvous for iov and moved 1 MiB iov frames at about a sixth of the contiguous bandwidth here
// (ucx_perftest -D iov,contig).
// Tag = [sender rank: 20 bits][first part of a frame: 1][message sequence mod 2^11: 11]
//       [frame bytes, on the first part: 32].
// Receiving probes the unexpected queue (ucp_tag_probe_nb, remove). The first part's tag gives the
// frame size, so the receiver allocates the frame's aligned_buffer at once and receives every
// part by its message handle straight to its offset: no second copy. UCX keeps the messages of
// one endpoint in order (tag matching does not overtake), which the sequence bits check; frames
// complete out of order (a rendezvous part after a later eager frame) and are delivered in order.
// Buffers of frames of pool_min_bytes or more are reused once every holder dropped them
// (buffer_pool): a fresh 16 MiB buffer per frame faulted in ~3,000 pages per frame here, which
// cost about as much as moving the frame.
// At most max_receives_outstanding parts (and max_receive_bytes_outstanding bytes, but always
// min_receives_outstanding parts) are being received at once; further messages wait in UCX (a
// rendezvous message moves no payload until its receive is posted). The small byte budget keeps
// the receive working set in cache: with 512 MiB, 32 frames of 1 MiB in flight each had their own
// buffer and the receiver ran at half of ucx_perftest's bandwidth (which receives into one
// buffer); with 4 MiB, at 0.91-0.99x. Pool buffers of 2 MiB or more use transparent huge pages
// (aligned_buffer::make_large): 16 MiB frames went from about 0.83x to 0.85-0.94x. UCX callbacks
// only record completions; progress() runs the user's callbacks afterwards, outside UCX.
#include "topology/ucx_transport.hpp"

#include <poll.h>
#include <ucp/api/ucp.h>

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
constexpr std::size_t pool_min_bytes = 64 << 10;
constexpr std::size_t pool_idle_bytes = std::size_t{512} << 20;
constexpr std::size_t max_receives_outstanding = 64;
constexpr std::size_t min_receives_outstanding = 2;
constexpr std::size_t max_receive_bytes_outstanding = std::size_t{4} << 20;
constexpr auto close_deadline = std::chrono::seconds(2);
constexpr int rank_bits = 20, sequence_bits = 11;
constexpr std::uint32_t sequence_mask = (1u << sequence_bits) - 1;

[[noreturn]] void fail(const std::string& what, ucs_status_t status) {
  throw ucx_error("ucx_transport: " + what + ": " + ucs_status_string(status));
}

std::uint64_t make_tag(int rank, bool first, std::uint32_t sequence, std::uint32_t frame_bytes) {
  return (std::uint64_t(rank) << 44) | (std::uint64_t(first) << 43) |
         (std::uint64_t(sequence & sequence_mask) << 32) | frame_bytes;
}

// Receive buffers by size class (a granule of 1/16 of the size's power of two, at least 4 KiB).
// take() hands out a buffer that no one else holds; it returns to the pool when its last holder
// drops it (on any thread), unless pool_idle_bytes are idle already.
class buffer_pool : public std::enable_shared_from_this<buffer_pool> {
 public:
  std::shared_ptr<messages::aligned_buffer> take(std::size_t bytes) {
    if (bytes < pool_min_bytes) return messages::aligned_buffer::make(bytes);
    const std::size_t granule = std::max<std::size_t>(4096, std::bit_floor(bytes) / 16);
    const std::size_t size = (bytes + granule - 1) / granule * granule;
    std::shared_ptr<messages::aligned_buffer> buffer;
    {
      std::lock_guard lock(mutex_);
      // The buffer released last (warmest in cache) first.
      if (auto it = idle_.upper_bound(size); it != idle_.begin() && (--it)->first == size) {
        buffer = std::move(it->second);
        idle_.erase(it);
        idle_bytes_ -= size;
      }
    }
    if (!buffer) buffer = messages::aligned_buffer::make_large(size);
    messages::aligned_buffer* raw = buffer.get();
    std::shared_ptr<void> lease(nullptr, [pool = shared_from_this(), size, buffer](void*) mutable {
      pool->give_back(size, std::move(buffer));
    });
    return std::shared_ptr<messages::aligned_buffer>(std::move(lease), raw);
  }

 private:
  // size: the size class the buffer was taken for (make_large may have rounded it up).
  void give_back(std::size_t size, std::shared_ptr<messages::aligned_buffer> buffer) {
    std::lock_guard lock(mutex_);
    if (idle_bytes_ + size > pool_idle_bytes) return;
    idle_bytes_ += size;
    idle_.emplace(size, std::move(buffer));
  }
  std::mutex mutex_;
  std::multimap<std::size_t, std::shared_ptr<messages::aligned_buffer>> idle_;
  std::size_t idle_bytes_ = 0;
};

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
    std::vector<std::byte> staging;  // the copied short entries
    send_callback done;
    std::vector<void*> requests;  // UCX requests of the parts still in flight at send()
    std::size_t completed = 0;
    bool in_use = false, posted = false;  // posted: every part was handed to UCX
    ucs_status_t status = UCS_OK;         // first failure of a part
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
    std::shared_ptr<messages::aligned_buffer> buffer;
    std::size_t bytes = 0;    // the frame's size (the buffer may be larger)
    std::size_t posted = 0;   // bytes of parts posted so far
    std::size_t pending = 0;  // part receives not yet completed
    bool ok = true, in_use = false;
    void reset() { *this = frame_state{}; }
  };
  struct recv_op {
    impl* owner = nullptr;
    int peer = 0;
    inbound* in = nullptr;
    frame_state* frame = nullptr;
    std::shared_ptr<messages::aligned_buffer> scratch;  // for a message that broke the protocol
    std::size_t bytes = 0;
    void* request = nullptr;
    bool in_use = false;
    ucs_status_t status = UCS_INPROGRESS;
    void reset() {
      in = nullptr;
      frame = nullptr;
      scratch.reset();
      request = nullptr;
      in_use = false;
      status = UCS_INPROGRESS;
    }
  };
  struct peer_state {
    impl* owner = nullptr;
    int peer = 0;
    ucp_ep_h ep = nullptr;
    std::uint32_t next_send = 0;
    bool error_handling = false;  // UCP_ERR_HANDLING_MODE_PEER on this endpoint
    std::string failure;          // non-empty once the peer failed
  };
  struct inbound {  // receiving side of one peer
    std::uint32_t next_sequence = 0;
    std::uint64_t next_frame = 0, next_delivery = 0;
    frame_state* assembling = nullptr;               // parts still to be posted
    std::map<std::uint64_t, frame_state*> complete;  // waiting for an earlier one
  };

  int rank = 0;
  ucx_options options;
  ucp_context_h context = nullptr;
  ucp_worker_h worker = nullptr;
  int event_fd = -1;
  std::shared_ptr<buffer_pool> pool = std::make_shared<buffer_pool>();
  std::map<int, peer_state> peers;  // node-based: err_handler args point into it
  std::map<int, inbound> inbounds;
  recycler<send_op> sends;
  recycler<recv_op> receives;
  recycler<frame_state> frames;
  std::vector<std::pair<const void*, std::size_t>> parts;  // send()'s scratch
  std::deque<send_op*> completed_sends;
  std::deque<recv_op*> completed_receives;
  std::deque<std::pair<int, std::string>> peer_errors;
  std::size_t receives_outstanding = 0, receive_bytes_outstanding = 0;
  receive_callback receive_fn;
  peer_error_callback peer_error_fn;
  bool dispatching = false;
  unsigned idle_polls = 0;

  static void send_done(void*, ucs_status_t status, void* user_data) {
    auto* op = static_cast<send_op*>(user_data);
    if (status != UCS_OK && op->status == UCS_OK) op->status = status;
    if (++op->completed == op->requests.size() && op->posted)
      op->owner->completed_sends.push_back(op);
  }
  static void recv_done(void* request, ucs_status_t status, const ucp_tag_recv_info_t*,
                        void* user_data) {
    auto* op = static_cast<recv_op*>(user_data);
    op->request = request;
    op->status = status;
    op->owner->completed_receives.push_back(op);
  }
  static void endpoint_failed(void* arg, ucp_ep_h, ucs_status_t status) {
    auto* p = static_cast<peer_state*>(arg);
    p->owner->peer_errors.emplace_back(
        p->peer, std::string("UCX endpoint error: ") + ucs_status_string(status));
  }

  peer_state& connected(int peer, const char* what) {
    auto it = peers.find(peer);
    if (it == peers.end())
      throw ucx_error("ucx_transport (rank " + std::to_string(rank) + "): " + what + " peer " +
                      std::to_string(peer) + ", which is not connected");
    return it->second;
  }

  // Which frame a probed message belongs to; nullptr (and a peer error) if it breaks the protocol.
  frame_state* frame_of(inbound& in, int peer, std::uint64_t tag, std::size_t length) {
    const bool first = (tag >> 43) & 1;
    const auto sequence = static_cast<std::uint32_t>(tag >> 32) & sequence_mask;
    std::string error;
    if (sequence != in.next_sequence)
      error = "message " + std::to_string(sequence) + " arrived where " +
              std::to_string(in.next_sequence) + " was due";
    else if (first == (in.assembling != nullptr))
      error = first ? "a frame started inside another" : "a frame part arrived without a frame";
    in.next_sequence = (sequence + 1) & sequence_mask;
    if (error.empty() && first) {
      in.assembling = frames.take();
      in.assembling->index = in.next_frame++;
      in.assembling->bytes = static_cast<std::uint32_t>(tag);
      in.assembling->buffer = pool->take(in.assembling->bytes);
    }
    if (error.empty() && in.assembling->posted + length > in.assembling->bytes)
      error = "frame parts exceed the frame's " + std::to_string(in.assembling->bytes) + " bytes";
    if (!error.empty()) {
      peer_errors.emplace_back(peer,
                               "protocol error from peer " + std::to_string(peer) + ": " + error);
      return nullptr;
    }
    return in.assembling;
  }

  // Posts receives for probed messages while under the outstanding bounds.
  unsigned post_receives() {
    unsigned posted = 0;
    while (receives_outstanding < max_receives_outstanding &&
           (receives_outstanding < min_receives_outstanding ||
            receive_bytes_outstanding < max_receive_bytes_outstanding)) {
      ucp_tag_recv_info_t info{};
      ucp_tag_message_h message = ucp_tag_probe_nb(worker, 0, 0, 1, &info);
      if (message == nullptr) break;
      recv_op* op = receives.take();
      op->owner = this;
      op->peer = static_cast<int>(info.sender_tag >> 44);
      op->in = &inbounds[op->peer];
      op->frame = frame_of(*op->in, op->peer, info.sender_tag, info.length);
      op->bytes = info.length;
      std::byte* target = nullptr;
      if (op->frame) {
        target = op->frame->buffer->data() + op->frame->posted;
        op->frame->posted += info.length;
        ++op->frame->pending;
        if (op->frame->posted == op->frame->bytes) op->in->assembling = nullptr;
      } else {
        op->scratch = messages::aligned_buffer::make(info.length);  // received, then dropped
        target = op->scratch->data();
      }
      ucp_request_param_t param{};
      param.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
      param.cb.recv = &recv_done;
      param.user_data = op;
      ++receives_outstanding;
      receive_bytes_outstanding += info.length;
      ucs_status_ptr_t r = ucp_tag_msg_recv_nbx(worker, target, info.length, message, &param);
      if (r == nullptr || UCS_PTR_IS_ERR(r)) {
        op->status = r == nullptr ? UCS_OK : UCS_PTR_STATUS(r);
        completed_receives.push_back(op);
      } else {
        op->request = r;  // recv_done records the completion
      }
      ++posted;
    }
    return posted;
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
    --receives_outstanding;
    receive_bytes_outstanding -= op->bytes;
    const int peer = op->peer;
    const ucs_status_t status = op->status;
    frame_state* frame = op->frame;
    inbound& in = *op->in;
    receives.give_back(op);
    if (status != UCS_OK && status != UCS_ERR_CANCELED)
      peer_errors.emplace_back(peer, std::string("receive failed: ") + ucs_status_string(status));
    if (!frame) return;
    frame->ok &= status == UCS_OK;
    if (--frame->pending > 0 || frame->posted < frame->bytes) return;
    if (frame->index != in.next_delivery) {  // an earlier frame is still arriving
      in.complete.emplace(frame->index, frame);
      return;
    }
    for (;;) {
      ++in.next_delivery;
      auto buffer = std::move(frame->buffer);
      const std::size_t bytes = frame->bytes;
      const bool ok = frame->ok;
      frames.give_back(frame);
      if (ok && receive_fn) receive_fn(peer, std::move(buffer), bytes);
      auto it = in.complete.find(in.next_delivery);
      if (it == in.complete.end()) return;
      frame = it->second;
      in.complete.erase(it);
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

  // Runs the user's callbacks for everything UCX completed. Returns how many events it handled.
  unsigned dispatch() {
    unsigned events = 0;
    dispatching = true;
    while (!completed_sends.empty() || !completed_receives.empty() || !peer_errors.empty()) {
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
  params.features = UCP_FEATURE_TAG | UCP_FEATURE_WAKEUP;
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
  if (auto es = ucp_worker_get_efd(impl_->worker, &impl_->event_fd); es != UCS_OK) {
    ucp_worker_destroy(impl_->worker);
    ucp_cleanup(impl_->context);
    fail("ucp_worker_get_efd", es);
  }
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
  if (peer_error_handling) {
    ep.field_mask |= UCP_EP_PARAM_FIELD_ERR_HANDLER;
    ep.err_handler.cb = &impl::endpoint_failed;
    ep.err_handler.arg = &p;
  }
  if (auto s = ucp_ep_create(impl_->worker, &ep, &p.ep); s != UCS_OK) {
    impl_->peers.erase(peer);
    fail("ucp_ep_create to peer " + std::to_string(peer), s);
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
  impl::send_op* op = impl_->sends.take();
  op->owner = impl_.get();
  op->peer = peer;
  op->done = std::move(done);
  op->staging.resize(staged);
  // Parts: long entries by reference; a run of short entries copied into one staging part, or
  // referenced in place when the run is a single entry.
  auto& parts = impl_->parts;
  parts.clear();
  std::size_t staged_at = 0, run_first = 0, run_entries = 0, run_bytes = 0;
  auto close_run = [&](std::size_t end) {
    if (run_entries == 1) {
      parts.push_back(iov[run_first]);
    } else if (run_entries > 1) {
      std::byte* at = op->staging.data() + staged_at;
      for (std::size_t k = run_first; k < end; ++k)
        if (iov[k].second < zero_copy_threshold && iov[k].second > 0) {
          std::memcpy(op->staging.data() + staged_at, iov[k].first, iov[k].second);
          staged_at += iov[k].second;
        }
      parts.emplace_back(at, run_bytes);
    }
    run_entries = run_bytes = 0;
  };
  for (std::size_t k = 0; k < iov.size(); ++k) {
    if (iov[k].second >= zero_copy_threshold) {
      close_run(k);
      parts.push_back(iov[k]);
    } else if (iov[k].second > 0) {
      if (run_entries++ == 0) run_first = k;
      run_bytes += iov[k].second;
    }
  }
  close_run(iov.size());
  static char nothing = 0;
  if (parts.empty()) parts.emplace_back(&nothing, 0);  // an empty frame is one empty message
  ucp_request_param_t param{};
  param.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
  param.cb.send = &impl::send_done;
  param.user_data = op;
  for (std::size_t i = 0; i < parts.size(); ++i) {
    const std::uint64_t tag = make_tag(impl_->rank, i == 0, p.next_send++,
                                       i == 0 ? static_cast<std::uint32_t>(total) : 0);
    ucs_status_ptr_t r = ucp_tag_send_nbx(p.ep, parts[i].first, parts[i].second, tag, &param);
    if (UCS_PTR_IS_ERR(r)) {
      if (op->status == UCS_OK) op->status = UCS_PTR_STATUS(r);
    } else if (r != nullptr) {
      op->requests.push_back(r);
    }
  }
  op->posted = true;
  if (op->completed == op->requests.size()) impl_->send_completed(op);  // all done at once
}

void ucx_transport::on_receive(receive_callback fn) { impl_->receive_fn = std::move(fn); }

void ucx_transport::on_peer_error(peer_error_callback fn) { impl_->peer_error_fn = std::move(fn); }

unsigned ucx_transport::progress() {
  if (impl_->dispatching)
    throw ucx_error("ucx_transport: progress() called from one of its own callbacks");
  unsigned events = ucp_worker_progress(impl_->worker);
  // New messages reach the unexpected queue in ucp_worker_progress: probe when it did something
  // (and every 16th idle call as a safety net), which keeps the busy-polling loop short.
  if (events > 0 || ++impl_->idle_polls % 16 == 0) events += impl_->post_receives();
  events += impl_->dispatch();
  // Completed receives freed room under the bounds: take the messages that were left waiting.
  if (events > 0) events += impl_->post_receives() + impl_->dispatch();
  return events;
}

void ucx_transport::wait(std::chrono::microseconds timeout) {
  if (!impl_->completed_sends.empty() || !impl_->completed_receives.empty() ||
      !impl_->peer_errors.empty())
    return;
  const ucs_status_t s = ucp_worker_arm(impl_->worker);
  if (s == UCS_ERR_BUSY) return;
  if (s != UCS_OK) fail("ucp_worker_arm", s);
  if (timeout.count() < 0) timeout = std::chrono::microseconds(0);
  pollfd fd{impl_->event_fd, POLLIN, 0};
  const timespec ts{static_cast<time_t>(timeout.count() / 1000000),
                    static_cast<long>(timeout.count() % 1000000) * 1000};
  if (::ppoll(&fd, 1, &ts, nullptr) < 0 && errno != EINTR)
    throw ucx_error(std::string("ucx_transport: ppoll on the UCX event fd: ") +
                    std::strerror(errno));
}

void ucx_transport::wake() { ucp_worker_signal(impl_->worker); }

std::string ucx_transport::transport_info(int peer) const {
  auto& p = impl_->connected(peer, "transport_info for");
  char* text = nullptr;
  std::size_t length = 0;
  FILE* stream = ::open_memstream(&text, &length);
  if (stream == nullptr) throw ucx_error("ucx_transport: open_memstream failed");
  ucp_ep_print_info(p.ep, stream);
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

}  // namespace troupe::topology
