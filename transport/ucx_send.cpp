// The sending side of the UCX transport (ucx_transport_impl.hpp): a small frame offered to UCX for
// immediate completion, any other frame planned into active messages with a recycled record.
#include "transport/ucx_transport_impl.hpp"

#include <algorithm>
#include <cstring>

namespace troupe::transport {
using namespace ucx_detail;
namespace {

const std::string no_error;  // `done`'s reason on success
// Sent now by UCX's short protocol, or refused (UCS_ERR_NO_RESOURCE) without a request.
const ucp_request_param_t force_immediate = [] {
  ucp_request_param_t param{};
  param.op_attr_mask = UCP_OP_ATTR_FLAG_FORCE_IMM_CMPL;
  return param;
}();

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

}  // namespace

void ucx_transport::impl::send_done(void*, ucs_status_t status, void* user_data) {
  auto* op = static_cast<send_op*>(user_data);
  if (status != UCS_OK && op->status == UCS_OK) op->status = status;
  if (++op->completed == op->requests.size() && op->posted)
    op->owner->completed_sends.push_back(op);
}

void ucx_transport::impl::send_completed(send_op* op) {
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
void ucx_transport::impl::send_with_record(peer_state& p, int peer, const iov_list& iov,
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

}  // namespace troupe::transport
