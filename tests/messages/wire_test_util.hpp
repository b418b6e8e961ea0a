// Shared fixtures of the wire codec tests: frames as a receiver sees them, refusals as text,
// payloads a careless codec would not keep, one filled message of each kind.
#pragma once

#include <catch2/catch.hpp>

#include <cstring>
#include <functional>
#include <random>

#include "engine/parallel/schedule.hpp"
#include "messages/wire_codec.hpp"

namespace wire_test {

using namespace troupe::messages;
using namespace troupe::messages::wire;
namespace engine = troupe::engine;

inline limits wide() { return {std::uint64_t{1} << 31, std::uint64_t{1} << 28, 1u << 20, 16}; }

// The frame as a receiver sees it: its iov copied into an aligned buffer, `offset` bytes in.
inline std::shared_ptr<aligned_buffer> gather(const frame& f, std::size_t offset = 0,
                                              std::size_t extra = 0) {
  auto buf = aligned_buffer::make(offset + f.bytes + extra);
  std::memset(buf->data(), 0, buf->size());
  std::size_t at = offset;
  for (const auto& [p, n] : f.iov) {
    std::memcpy(buf->data() + at, p, n);
    at += n;
  }
  REQUIRE(at == offset + f.bytes);
  return buf;
}

inline envelope round_trip(const envelope& e, const limits& lim = wide()) {
  const frame f = encode(e);
  return decode(gather(f), f.bytes, lim);
}

// The wire_error message of f, or a marker no check matches.
inline std::string refused_with(const std::function<void()>& f) {
  try {
    f();
  } catch (const wire_error& e) {
    return e.what();
  } catch (const std::exception& e) {
    return std::string("<not a wire_error: ") + e.what() + ">";
  }
  return "<no exception thrown>";
}
inline std::string refused_with(const frame& f, const limits& lim = wide()) {
  return refused_with([&] { decode(gather(f), f.bytes, lim); });
}

// Floats that a careless codec would not keep: NaN payloads, -0, denormals, infinities, then
// random bit patterns.
inline float_buffer floats(std::size_t n, std::uint32_t seed) {
  static constexpr std::uint32_t special[] = {0x7fc00001u, 0x7f800001u, 0xffffffffu, 0x80000000u,
                                              0x00000001u, 0x807fffffu, 0x7f800000u, 0xff800000u};
  auto p = std::make_shared<payload<float>>(n);
  std::mt19937 rng(seed);
  for (std::size_t i = 0; i < n; ++i) {
    const std::uint32_t bits = i < std::size(special) ? special[i] : rng();
    std::memcpy(p->data() + i, &bits, 4);
  }
  return p;
}
inline token_buffer tokens(std::size_t n) {
  auto p = std::make_shared<payload<std::int32_t>>(n);
  for (std::size_t i = 0; i < n; ++i) (*p)[i] = static_cast<std::int32_t>(i * 7919 % 50257) - 3;
  return p;
}
template <class T>
bool same_bits(const T* a, std::size_t n, const T* b, std::size_t m) {
  return n == m && (n == 0 || std::memcmp(a, b, n * sizeof(T)) == 0);
}
template <class P>
void check_payload(const P& want, const P& got) {
  REQUIRE(want);
  REQUIRE(got);
  CHECK(same_bits(want->data(), want->size(), got->data(), got->size()));
  CHECK(got->is_view());
}

inline link_header header(link_kind kind, std::vector<std::int64_t> shape) {
  return {kind, 3, 1, 2, 1, 0, false, std::move(shape)};
}

// One filled message of each kind, by variant index.
inline body sample(std::size_t kind) {
  switch (kind) {
    case 0:
      return link_message{header(link_kind::gradient, {2, 3, 5}), floats(30, 1), 1ull << 52};
    case 1:
      return link_credit{{link_kind::activation, 7, 2, 3, 4, 1, true, {}}};
    case 2:
      return batch_message{batch_part::targets, 9, 1, 3, 1, true, 2, 5, tokens(10), 77};
    case 3:
      return batch_credit{batch_part::targets, 3};
    case 4:
      return step_plan{12, 2, false,  // a training plan (eval plans: their own test)
                       std::make_shared<const engine::pipeline_plan>(
                           engine::make_plan("zb_h1", engine::schedule_shape{2, 4, 1})),
                       131072.0};
    case 5:
      return begin_step{8, 3, 0.25};
    case 6:
      return begin_eval{100, 16};
    case 7:
      return grads_ready{4, 1, 2, 0.125, -1e300, 4};
    case 8:
      return apply_update{5, 3.5e-7, true, 1.0 / 65536};
    case 9:
      return update_done{
          5,
          1,
          0,
          2e-3,
          {1, 2, 1 << 20, 3 << 20, std::int64_t{5} << 32, 77, 4096, std::int64_t{3} << 33}};
    case 10:
      return eval_done{6, 1, 12.75, 8};
    case 11:
      return tied_grad{6, 1, floats(33, 2)};
    case 12:
      return snapshot_request{12, true, true, "runs/x/checkpoints/step-00000012"};
    case 13: {
      const auto p = floats(5, 3);
      return stage_snapshot{
          1,
          2,
          {{"transformer.wte.weight", {p->begin(), p->end()}}, {"", {}}},
          {{tensor_role::exp_avg_sq, "transformer.wpe.weight", 1234, {p->begin(), p->end()}},
           {tensor_role::parameter, "", 0, {}}},
          {"part-001-002.safetensors", 123456789, 0xfedcba9876543210ull}};
    }
    case 14: {
      engine::trace::event a{engine::trace::event_kind::span, 3, "compute", "F", 12.5, 3.25};
      a.step = 1, a.micro_batch = 2, a.virtual_stage = 3, a.bytes = 1 << 20;
      engine::trace::event b{engine::trace::event_kind::flow_out, 1, "flow", "micro-batch", 1e9};
      b.flow_id = (1ull << 53) - 1;
      engine::trace::event c{engine::trace::event_kind::instant, 0, "", "stage 1 · dp 0", -0.0};
      return trace_batch{{a, b, c, {}}};
    }
    case 15:
      return step_report{{7,
                          600,
                          2.5,
                          2.75,
                          1e-3,
                          0.9,
                          1234.5,
                          80.25,
                          12.5,
                          4096,
                          3e9,
                          {{0, 0, 100, 200, 300, 4, 9, 10}, {1, 1, 5, 6, 7, 8, 0, 11}},
                          "loss spike: z-score 7.5 > 6",
                          32768.0}};
    case 16:
      return heartbeat{3, ~0ull};
    case 17:
      return actor_down{0xfffffffeu, "stage 2 · dp 0 stopped: out of memory"};
    case 18:
      return error_report{2, "wire: link_message.data: missing payload"};
    case 19:
      return job_shutdown{false, "rank 3 lost"};
    case 20:
      return ring_chunk{4, 1, 3, 2, 1, 5, floats(64, 4), 2};
    case 21:
      return checkpoint_chunk{9, "step_9/rank_1.bin", 1ull << 40, 0x0123456789abcdefull,
                              floats(7, 5)};
    default:
      return tensor_exchange{(1ull << 40) + 3, 2, tensor_exchange::op::sum_f64, floats(12, 6),
                             "stage 0 · dp 0 · tp 1 stopped"};
  }
}

}  // namespace wire_test
