// The UCX transport (ucx_transport.hpp; its inside and design: ucx_transport_impl.hpp): context,
// worker, endpoints, progress, wait and shutdown. Receiving: ucx_receive.cpp; sending:
// ucx_send.cpp.
#include "transport/ucx_transport_impl.hpp"

#include <poll.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <set>
#include <sstream>

namespace troupe::transport {
using namespace ucx_detail;
namespace {

constexpr auto close_deadline = std::chrono::seconds(2);
constexpr int rank_bits = 20;

[[noreturn]] void fail(const std::string& what, ucs_status_t status) {
  throw ucx_error("ucx_transport: " + what + ": " + ucs_status_string(status));
}

}  // namespace

void ucx_transport::impl::endpoint_failed(void* arg, ucp_ep_h, ucs_status_t status) {
  auto* p = static_cast<peer_state*>(arg);
  p->owner->peer_errors.emplace_back(p->peer,
                                     std::string("endpoint error: ") + ucs_status_string(status));
}

// The transports/devices of an endpoint's lanes, e.g. "posix/memory cma/memory", from
// ucp_ep_print_info.
std::string ucx_transport::impl::lanes(ucp_ep_h ep) {
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

ucx_transport::impl::peer_state& ucx_transport::impl::look_up(int peer, const char* what) {
  auto it = peers.find(peer);
  if (it == peers.end())
    throw ucx_error("ucx_transport (rank " + std::to_string(rank) + "): " + what + " peer " +
                    std::to_string(peer) + ", which is not connected");
  last_peer = peer;
  last_peer_state = &it->second;
  return it->second;
}

void ucx_transport::impl::report_peer_failure(int peer, const std::string& reason) {
  auto it = peers.find(peer);
  if (it != peers.end()) {
    if (!it->second.failure.empty()) return;
    it->second.failure = reason;
  }
  if (peer_error_fn) peer_error_fn(peer, reason);
}

// Closes every endpoint (flush; force once the peer failed in PEER mode), cancels receives,
// progresses until all close or the deadline passes, then releases every request UCX still
// holds (no callback runs for a released request), so the worker can be destroyed.
void ucx_transport::impl::shut_down() {
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
    const auto slash = lane.find('/');  // "transport/device"
    const std::string tl = lane.substr(0, slash);
    impl_->inbounds[peer].local |= tl == "cma" || tl == "knem" || tl == "xpmem";
    impl_->inbounds[peer].loopback |=
        slash != std::string::npos && lane.compare(slash + 1, std::string::npos, "lo") == 0;
  }
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

std::uint32_t ucx_transport::messages_arrived(int peer) const {
  const auto it = impl_->inbounds.find(peer);  // next_sequence: one past the last arrival
  return it == impl_->inbounds.end() ? 0 : it->second.next_sequence;
}

std::string ucx_transport::transport_info(int peer) const {
  return impl::lanes(impl_->connected(peer, "transport_info for").ep);
}

}  // namespace troupe::transport
