// The wire codec: one message that crosses a process (messages/pipeline.hpp, messages/remote.hpp)
// in an envelope, to and from one Cap'n Proto frame (schema: messages/wire.capnp). Cap'n Proto
// types stay in wire_codec.cpp; gateways and transports see only these structs.
//
// Invariants:
//  - Zero copies of tensor payloads on either side. encode references each payload's own bytes
//    from the frame's iov (a payload that is not 8-byte aligned, or a stage_snapshot's
//    std::vector parameters, is copied once into the frame instead); decode returns payload views
//    into the receive buffer that keep it alive.
//  - A frame is [segment table][segment 0][segment 1]...; a payload of more than 2^29 - 64 bytes
//    travels as several pieces in consecutive segments and is read back as one view.
//  - decode trusts nothing from the peer: every size, count and nesting depth is checked against
//    the caller's limits (derive them with limits_for), and every failure, Cap'n Proto's included,
//    is a wire_error whose one-line message names the message kind and the field or limit at
//    fault ("wire: link_message.data: 65537 elements exceed max_tensor_elements 65536").
//  - Tensor payloads are required: encoding a null payload (or a step_plan without a plan) throws
//    wire_error, and decoding refuses a frame without one.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string_view>
#include <utility>
#include <variant>
#include <vector>

#include "engine/training/recipe.hpp"
#include "messages/aligned_buffer.hpp"
#include "messages/pipeline.hpp"
#include "messages/remote.hpp"

namespace troupe::messages::wire {

struct wire_error : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// Reader limits, always explicit (never Cap'n Proto's defaults, never the peer's word). A zero
// limit admits nothing of that kind.
struct limits {
  std::uint64_t max_frame_bytes = 0;      // whole frame, payloads included
  std::uint64_t max_tensor_elements = 0;  // one tensor payload
  std::uint32_t max_list_elements =
      0;  // plan actions, parameter names, trace events, shape dims...
  std::uint32_t max_nesting = 16;
};

// The limits of a job running recipe r; the derivation is documented at its definition
// (wire_codec.cpp). Throws engine::recipe_error or std::invalid_argument for an impossible layout.
limits limits_for(const engine::recipe& r);

using body =
    std::variant<link_message, link_credit, batch_message, batch_credit, step_plan, begin_step,
                 begin_eval, grads_ready, apply_update, update_done, eval_done, tied_grad,
                 snapshot_request, stage_snapshot, trace_batch, step_report, heartbeat, actor_down,
                 error_report, job_shutdown, ring_chunk, checkpoint_chunk, tensor_exchange>;

struct envelope {
  std::uint32_t target = 0;       // job-wide actor id at the receiver (0 = the receiving gateway)
  std::int32_t source_rank = 0;   // sending process
  std::uint64_t correlation = 0;  // request/response pairing; 0 = none
  bool reply = false;             // this envelope answers `correlation`
  body message;
};

// A frame ready for one vectored send: iov = [segment table][segment 0's words][padding][payload
// piece]... as one segment whose Data pointers point past the words the builder wrote, or, for a
// message the builder needed several segments for, [segment table][segment 0][segment 1]... with
// a segment per payload piece. Tensor payloads are referenced, never copied: the iov entry of a
// payload points at the payload's own bytes (a payload whose size is not a multiple of 8 is
// followed by an entry of zero padding; a misaligned view is copied once in the second layout).
// `keep` owns the MessageBuilder and shares ownership of every payload referenced, so the frame
// stays valid while `keep` lives, even if the caller drops the message. Once the last holder of
// `keep` drops it, the builder's memory is reused by a later encode (on any thread).
struct frame {
  std::vector<std::pair<const void*, std::size_t>> iov;
  std::size_t bytes = 0;  // sum of the iov lengths
  std::shared_ptr<void> keep;
};
frame encode(const envelope& e);

// Decodes one whole frame of `bytes` bytes at buf->data(). Tensor payloads in the result are
// views into `buf` (payload::is_view() is true; they keep buf alive); no payload copy. Throws
// wire_error naming the message kind and the field or limit at fault for: a frame over
// max_frame_bytes, a truncated frame, an unaligned buffer, a tensor over max_tensor_elements, a
// list over max_list_elements, a shape whose product disagrees with the payload size, an unknown
// schema id or version, a plan that does not pass engine::check_plan.
envelope decode(std::shared_ptr<aligned_buffer> buf, std::size_t bytes, const limits& lim);

// Name of the message kind held (for errors and traces): "link_message", "heartbeat", ...
std::string_view kind_name(const body& b);

namespace detail {
// Name of the kind with this union discriminant (the variant's index); "" past the last kind.
std::string_view kind_name_at(std::size_t index);
// The largest Data piece encode writes: a multiple of 64 under Cap'n Proto's 2^29-byte blob limit.
inline constexpr std::size_t max_piece_bytes = (std::size_t{1} << 29) - 64;
// encode with another piece size (a positive multiple of 8, at most max_piece_bytes), so that
// tests can exercise the splitting of large payloads with small ones.
frame encode(const envelope& e, std::size_t piece_bytes);
// decode of a frame at `data` (any address; refused unless 8-byte aligned) whose writable memory
// `owner` keeps alive: for a transport that receives several frames into one buffer, and for tests.
envelope decode(std::shared_ptr<void> owner, std::byte* data, std::size_t bytes, const limits& lim);
}  // namespace detail

}  // namespace troupe::messages::wire
