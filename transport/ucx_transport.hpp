// Whole wire frames between processes over UCX (active messages), without CAF. One context and one
// worker per process, driven by a single thread (the gateway's progress actor); only wake() may be
// called from another thread.
//
// Invariants:
// - A frame is sent from the caller's buffers: iov entries of 16 KiB or more are never copied
//   (UCX reads them by zero-copy rendezvous), shorter ones are copied into the active message's
//   header (or one staging copy when too long for it). An activation frame is one message.
//   The buffers must stay valid until the send's `done` runs.
// - A frame arrives whole, at the start of a 64-byte aligned messages::aligned_buffer that no
//   one else holds; the buffer may be larger than the frame (buffers are pooled by size class and
//   reused once every holder has dropped them).
//   Frames from one peer are delivered in the order that peer sent them.
// - Ranks are in [0, 2^20); a frame is at most 4 GiB - 1 (the message header's 32-bit size).
// - Every callback (send `done`, on_receive, on_peer_error) runs from progress() or, for a send
//   that completes at once, inline in send(); never from inside UCX's own callbacks.
// - The destructor never hangs: endpoints are flushed and closed under a deadline, and sends
//   still pending then are completed with done(false, ...).
// UCX headers stay in the .cpp (pimpl) so the gateway's translation units do not see them.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "messages/aligned_buffer.hpp"

namespace troupe::transport {

struct ucx_error : std::runtime_error {
  using std::runtime_error::runtime_error;
};

struct ucx_options {
  // UCX_TLS for this worker ("" = UCX's choice: shm locally, tcp across hosts).
  std::string transports;
  // UCP_ERR_HANDLING_MODE_PEER. false keeps shared memory but leaves a lost peer mostly
  // undetected (only a failed cma fetch from it is reported), and over tcp UCX 1.13 can abort
  // this process when a peer dies while tcp lanes are being wired up (docs/transport.md).
  bool peer_error_handling = false;
  std::string net_devices;  // UCX_NET_DEVICES ("" = all)
  // wait() keeps polling the worker this long before it arms it and sleeps: an event that comes
  // sooner is handled without a wake-up (about 20 us on the development machine, against a 0.3 us
  // round trip over shared memory). Spin then block: polling as long as one wake-up costs never
  // loses more than twice the better choice. 0 = sleep at once.
  std::chrono::microseconds poll_before_sleep{20};
};

using iov_list = std::vector<std::pair<const void*, std::size_t>>;

class ucx_transport {
 public:
  using send_callback = std::function<void(bool ok, const std::string& error)>;
  using receive_callback =
      std::function<void(int peer, std::shared_ptr<messages::aligned_buffer>, std::size_t bytes)>;
  using peer_error_callback = std::function<void(int peer, const std::string& reason)>;

  // One context + one worker (single-threaded). Throws ucx_error naming the failing call, the
  // rejected UCX_TLS, or a rank outside [0, 2^20).
  explicit ucx_transport(int rank, const ucx_options& options = {});
  // Flushes and closes endpoints, never hangs (deadline); then runs the `done` of every send not
  // yet reported (done(false, ...) unless it had completed), which must not use the transport.
  ~ucx_transport();
  ucx_transport(const ucx_transport&) = delete;
  ucx_transport& operator=(const ucx_transport&) = delete;

  int rank() const;
  // Worker address blob, exchanged at rendezvous.
  std::vector<std::uint8_t> address() const;
  // Creates the endpoint to `peer` (once per peer; a second call throws), with the options'
  // peer_error_handling, or with the mode given for this endpoint alone: on for a peer on
  // another host (tcp either way; a lost peer is reported), off for one on this host (keeps
  // shared memory, which the mode would turn off).
  void connect(int peer, const std::vector<std::uint8_t>& address);
  void connect(int peer, const std::vector<std::uint8_t>& address, bool peer_error_handling);

  // One whole frame to peer, vectored and zero-copy: UCX reads the caller's buffers, which must
  // stay valid until `done` runs (from progress(), or inline if UCX completed immediately).
  // Frames to one peer arrive in send order. done(false, reason) on failure (a frame over 4 GiB,
  // a failed peer, a UCX error). Throws ucx_error for a peer that was never connected.
  void send(int peer, const iov_list& iov, send_callback done);
  // Every received frame, whole, in the first `bytes` bytes of an aligned_buffer no one else
  // holds, from progress().
  void on_receive(receive_callback fn);
  // UCX reported an endpoint failure to this peer: on an endpoint in peer_error_handling mode, a
  // failed send or receive, or (without that mode) a failed cma fetch from a local peer that
  // died. Reported once per peer; later sends to it fail at once.
  void on_peer_error(peer_error_callback fn);

  // Handles ready events; 0 = nothing happened. Not re-entrant: callbacks must not call it.
  unsigned progress();
  // Returns when UCX has work or on wake(), at the latest after `timeout`: polls the worker for
  // up to options.poll_before_sleep, then sleeps (ucp_worker_arm + poll on ucp_worker_get_efd).
  void wait(std::chrono::microseconds timeout);
  // Thread-safe: interrupts wait() (ucp_worker_signal).
  void wake();

  // How many messages have arrived from peer so far (a frame is one or more), counted when UCX
  // hands each one over, before the frame is whole or delivered; 0 for a peer never heard.
  // Wraps at 2^32: compare for change only. A peer whose frames wait behind this process's own
  // receive backlog (per-peer order, receives under their bounds) is still heard from by this
  // count (the gateway's liveness check, docs/processes.md).
  std::uint32_t messages_arrived(int peer) const;

  // The transports/devices the endpoint to peer uses, e.g. "posix/memory cma/memory" or
  // "tcp/lo", from ucp_ep_print_info. Throws ucx_error for an unknown peer.
  std::string transport_info(int peer) const;

 private:
  struct impl;
  std::unique_ptr<impl> impl_;
};

}  // namespace troupe::transport
