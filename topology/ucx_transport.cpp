// UCX tag-matching transport for whole wire frames (see ucx_transport.hpp for the contract).
//
// Wire: one UCX tag message per frame, tag = (sender rank << 32) | per-peer sequence number.
// Receiving probes the unexpected queue (ucp_tag_probe_nb, remove) and receives each message by
// its handle straight into a fresh aligned_buffer of the probed length, so eager and rendezvous
// frames both land in memory the receiver owns without a second copy. At most
// max_receives_outstanding receives (and max_receive_bytes_outstanding bytes) are posted or held
// back for ordering at once; further messages wait in UCX. UCX callbacks only record
// completions; progress() runs the user's callbacks afterwards, outside UCX.
#include "topology/ucx_transport.hpp"

#include <poll.h>
#include <ucp/api/ucp.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <deque>
#include <map>
#include <set>
#include <sstream>
#include <unordered_map>
#include <utility>

namespace troupe::topology {
namespace {

constexpr std::size_t max_receives_outstanding = 64;
constexpr std::size_t max_receive_bytes_outstanding = std::size_t{512} << 20;
constexpr auto close_deadline = std::chrono::seconds(2);

[[noreturn]] void fail(const std::string& what, ucs_status_t status) {
  throw ucx_error("ucx_transport: " + what + ": " + ucs_status_string(status));
}

std::uint64_t make_tag(int rank, std::uint32_t sequence) {
  return (static_cast<std::uint64_t>(static_cast<std::uint32_t>(rank)) << 32) | sequence;
}

}  // namespace

struct ucx_transport::impl {
  struct send_op {
    impl* owner = nullptr;
    int peer = 0;
    std::vector<ucp_dt_iov_t> iov;
    send_callback done;
    void* request = nullptr;
    ucs_status_t status = UCS_INPROGRESS;
  };
  struct recv_op {
    impl* owner = nullptr;
    int peer = 0;
    std::uint32_t sequence = 0;
    std::shared_ptr<messages::aligned_buffer> buffer;
    std::size_t bytes = 0;
    void* request = nullptr;
    ucs_status_t status = UCS_INPROGRESS;
  };
  struct peer_state {
    impl* owner = nullptr;
    int peer = 0;
    ucp_ep_h ep = nullptr;
    std::uint32_t next_send = 0;
    std::string failure;  // non-empty once the peer failed
  };
  struct arrived_frame {
    std::shared_ptr<messages::aligned_buffer> buffer;
    std::size_t bytes = 0;
    bool ok = true;
  };
  struct receive_order {
    std::uint32_t next = 0;
    std::map<std::uint32_t, arrived_frame> arrived;  // completed, waiting for an earlier frame
  };

  int rank = 0;
  ucx_options options;
  ucp_context_h context = nullptr;
  ucp_worker_h worker = nullptr;
  int event_fd = -1;
  std::map<int, peer_state> peers;  // node-based: err_handler args point into it
  std::map<int, receive_order> orders;
  std::unordered_map<send_op*, std::unique_ptr<send_op>> sends;
  std::unordered_map<recv_op*, std::unique_ptr<recv_op>> receives;
  std::deque<send_op*> completed_sends;
  std::deque<recv_op*> completed_receives;
  std::deque<std::pair<int, std::string>> peer_errors;
  std::size_t receives_outstanding = 0, receive_bytes_outstanding = 0;
  receive_callback receive_fn;
  peer_error_callback peer_error_fn;
  bool dispatching = false;

  static void send_done(void* request, ucs_status_t status, void* user_data) {
    auto* op = static_cast<send_op*>(user_data);
    op->request = request;
    op->status = status;
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

  // Posts receives for probed messages while under the outstanding bounds.
  unsigned post_receives() {
    unsigned posted = 0;
    while (receives_outstanding < max_receives_outstanding &&
           receive_bytes_outstanding < max_receive_bytes_outstanding) {
      ucp_tag_recv_info_t info{};
      ucp_tag_message_h message = ucp_tag_probe_nb(worker, 0, 0, 1, &info);
      if (message == nullptr) break;
      auto op = std::make_unique<recv_op>();
      op->owner = this;
      op->peer = static_cast<int>(static_cast<std::uint32_t>(info.sender_tag >> 32));
      op->sequence = static_cast<std::uint32_t>(info.sender_tag);
      op->bytes = info.length;
      op->buffer = messages::aligned_buffer::make(info.length);
      ucp_request_param_t param{};
      param.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
      param.cb.recv = &recv_done;
      param.user_data = op.get();
      ++receives_outstanding;
      receive_bytes_outstanding += info.length;
      ucs_status_ptr_t r =
          ucp_tag_msg_recv_nbx(worker, op->buffer->data(), info.length, message, &param);
      recv_op* raw = op.get();
      receives.emplace(raw, std::move(op));
      if (r == nullptr) {
        raw->status = UCS_OK;
        completed_receives.push_back(raw);
      } else if (UCS_PTR_IS_ERR(r)) {
        raw->status = UCS_PTR_STATUS(r);
        completed_receives.push_back(raw);
      } else {
        raw->request = r;  // recv_done records the completion (it may already have)
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

  // Runs the user's callbacks for everything UCX completed. Returns how many events it handled.
  unsigned dispatch() {
    unsigned events = 0;
    dispatching = true;
    while (!completed_sends.empty() || !completed_receives.empty() || !peer_errors.empty()) {
      while (!completed_receives.empty()) {
        recv_op* op = completed_receives.front();
        completed_receives.pop_front();
        auto owned = std::move(receives.at(op));
        receives.erase(op);
        if (op->request) ucp_request_free(op->request);
        --receives_outstanding;
        receive_bytes_outstanding -= op->bytes;
        const bool ok = op->status == UCS_OK;
        if (!ok && op->status != UCS_ERR_CANCELED)
          peer_errors.emplace_back(op->peer,
                                   std::string("receive failed: ") + ucs_status_string(op->status));
        auto& order = orders[op->peer];
        order.arrived[op->sequence] = arrived_frame{std::move(op->buffer), op->bytes, ok};
        for (auto it = order.arrived.find(order.next); it != order.arrived.end();
             it = order.arrived.find(order.next)) {
          arrived_frame frame = std::move(it->second);
          order.arrived.erase(it);
          ++order.next;
          if (frame.ok && receive_fn) receive_fn(op->peer, std::move(frame.buffer), frame.bytes);
        }
        ++events;
      }
      while (!completed_sends.empty()) {
        send_op* op = completed_sends.front();
        completed_sends.pop_front();
        auto owned = std::move(sends.at(op));
        sends.erase(op);
        if (op->request) ucp_request_free(op->request);
        if (op->status == UCS_OK) {
          op->done(true, {});
        } else {
          const std::string reason = std::string("send to peer ") + std::to_string(op->peer) +
                                     " failed: " + ucs_status_string(op->status);
          op->done(false, reason);
          peer_errors.emplace_back(op->peer, reason);
        }
        ++events;
      }
      while (!peer_errors.empty()) {
        auto [peer, reason] = std::move(peer_errors.front());
        peer_errors.pop_front();
        report_peer_failure(peer, reason);
        ++events;
      }
    }
    dispatching = false;
    return events;
  }

  // Closes every endpoint (flush; force once the peer failed in PEER mode), cancels receives,
  // progresses until all close or the deadline passes, then releases every request UCX still
  // holds (no callback runs for a released request), so the worker can be destroyed.
  void shut_down() {
    for (auto& [r, op] : receives)
      if (op->request && op->status == UCS_INPROGRESS) ucp_request_cancel(worker, op->request);
    std::vector<void*> closing;
    for (auto& [peer, p] : peers) {
      ucp_request_param_t param{};
      param.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
      param.flags =
          options.peer_error_handling && !p.failure.empty() ? UCP_EP_CLOSE_FLAG_FORCE : 0;
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
      for (auto& [r, op] : receives) receiving |= op->status == UCS_INPROGRESS;
      if (closing.empty() && !receiving) break;
    }
    for (void* r : closing) ucp_request_free(r);
    for (auto& [r, op] : receives)
      if (op->request) ucp_request_free(std::exchange(op->request, nullptr));
    for (auto& [s, op] : sends)
      if (op->request) ucp_request_free(std::exchange(op->request, nullptr));
  }
};

ucx_transport::ucx_transport(int rank, const ucx_options& options)
    : impl_(std::make_unique<impl>()) {
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
  if (s != UCS_OK) fail("ucp_init (UCX_TLS='" + options.transports + "')", s);
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
  // Completions recorded while closing keep their status; whatever is still pending fails.
  for (auto& [op, owned] : impl_->sends)
    if (op->status == UCS_INPROGRESS) op->status = UCS_ERR_CANCELED;
  auto sends = std::move(impl_->sends);
  ucp_worker_destroy(impl_->worker);
  ucp_cleanup(impl_->context);
  for (auto& [op, owned] : sends) {
    if (op->status == UCS_OK)
      op->done(true, {});
    else
      op->done(false, "ucx_transport closed before the send to peer " + std::to_string(op->peer) +
                          " completed: " + ucs_status_string(op->status));
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
  if (impl_->peers.count(peer))
    throw ucx_error("ucx_transport: peer " + std::to_string(peer) + " is already connected");
  if (address.empty())
    throw ucx_error("ucx_transport: empty worker address for peer " + std::to_string(peer));
  auto& p = impl_->peers[peer];
  p.owner = impl_.get();
  p.peer = peer;
  ucp_ep_params_t ep{};
  ep.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE;
  ep.address = reinterpret_cast<const ucp_address_t*>(address.data());
  ep.err_mode =
      impl_->options.peer_error_handling ? UCP_ERR_HANDLING_MODE_PEER : UCP_ERR_HANDLING_MODE_NONE;
  if (impl_->options.peer_error_handling) {
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
  if (!p.failure.empty()) {
    done(false, "peer " + std::to_string(peer) + " failed earlier: " + p.failure);
    return;
  }
  auto op = std::make_unique<impl::send_op>();
  op->owner = impl_.get();
  op->peer = peer;
  op->done = std::move(done);
  op->iov.reserve(iov.size());
  for (const auto& [data, length] : iov) op->iov.push_back({const_cast<void*>(data), length});
  ucp_request_param_t param{};
  param.op_attr_mask =
      UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_DATATYPE;
  param.cb.send = &impl::send_done;
  param.user_data = op.get();
  param.datatype = ucp_dt_make_iov();
  const std::uint64_t tag = make_tag(impl_->rank, p.next_send++);
  ucs_status_ptr_t r = ucp_tag_send_nbx(p.ep, op->iov.data(), op->iov.size(), tag, &param);
  if (r == nullptr) {
    op->done(true, {});
  } else if (UCS_PTR_IS_ERR(r)) {
    const std::string reason =
        "send to peer " + std::to_string(peer) + " failed: " + ucs_status_string(UCS_PTR_STATUS(r));
    op->done(false, reason);
    impl_->peer_errors.emplace_back(peer, reason);
  } else {
    op->request = r;
    impl::send_op* raw = op.get();
    impl_->sends.emplace(raw, std::move(op));
  }
}

void ucx_transport::on_receive(receive_callback fn) { impl_->receive_fn = std::move(fn); }

void ucx_transport::on_peer_error(peer_error_callback fn) { impl_->peer_error_fn = std::move(fn); }

unsigned ucx_transport::progress() {
  if (impl_->dispatching)
    throw ucx_error("ucx_transport: progress() called from one of its own callbacks");
  unsigned events = ucp_worker_progress(impl_->worker);
  events += impl_->post_receives();
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
