// The wire codec: every message kind round-trips field by field with bit-equal payloads; payloads
// are referenced on send (the iov points at the payload) and viewed on receive (no copy); large
// payloads split into pieces and come back as one view; every malformed or oversized frame is a
// wire_error naming what is wrong (limits, truncation, alignment, shapes, version, schema, plans,
// random and mutated bytes); limits_for on the default recipe admits what the recipe sends.
// Frames are patched by hand in a few tests, following the Cap'n Proto encoding spec
// (capnproto.org/encoding.html) and the Envelope layout `capnp compile -ocapnp` prints.
#include <catch2/catch.hpp>

#include <cstring>
#include <functional>
#include <random>

#include "engine/pipeline_layout.hpp"
#include "engine/schedule.hpp"
#include "messages/wire_codec.hpp"

using namespace troupe::messages;
using namespace troupe::messages::wire;
namespace engine = troupe::engine;

namespace {

limits wide() { return {std::uint64_t{1} << 31, std::uint64_t{1} << 28, 1u << 20, 16}; }

// The frame as a receiver sees it: its iov copied into an aligned buffer, `offset` bytes in.
std::shared_ptr<aligned_buffer> gather(const frame& f, std::size_t offset = 0,
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

envelope round_trip(const envelope& e, const limits& lim = wide()) {
  const frame f = encode(e);
  return decode(gather(f), f.bytes, lim);
}

// The wire_error message of f, or a marker no check matches.
std::string refusal(const std::function<void()>& f) {
  try {
    f();
  } catch (const wire_error& e) {
    return e.what();
  } catch (const std::exception& e) {
    return std::string("<not a wire_error: ") + e.what() + ">";
  }
  return "<no exception thrown>";
}
std::string refusal(const frame& f, const limits& lim = wide()) {
  return refusal([&] { decode(gather(f), f.bytes, lim); });
}

// Floats that a careless codec would not keep: NaN payloads, -0, denormals, infinities, then
// random bit patterns.
float_buffer floats(std::size_t n, std::uint32_t seed) {
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
token_buffer tokens(std::size_t n) {
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

link_header header(link_kind kind, std::vector<std::int64_t> shape) {
  return {kind, 3, 1, 2, 1, 0, false, std::move(shape)};
}

// One filled message of each kind, by variant index.
body sample(std::size_t kind) {
  switch (kind) {
    case 0: return link_message{header(link_kind::gradient, {2, 3, 5}), floats(30, 1), 1ull << 52};
    case 1: return link_credit{{link_kind::activation, 7, 2, 3, 4, 1, true, {}}};
    case 2: return batch_message{batch_part::targets, 9, 1, 3, 1, true, 2, 5, tokens(10), 77};
    case 3: return batch_credit{batch_part::targets, 3};
    case 4:
      return step_plan{12, 2, true,
                       std::make_shared<const engine::pipeline_plan>(
                           engine::make_plan("zb_h1", engine::schedule_shape{2, 4, 1}))};
    case 5: return begin_step{8, 3};
    case 6: return begin_eval{100, 16};
    case 7: return grads_ready{4, 1, 2, 0.125, -1e300, 4};
    case 8: return apply_update{5, 3.5e-7};
    case 9: return update_done{5, 1, 0, 2e-3};
    case 10: return eval_done{6, 1, 12.75, 8};
    case 11: return tied_grad{6, 1, floats(33, 2)};
    case 12: return snapshot_request{};
    case 13: {
      const auto p = floats(5, 3);
      return stage_snapshot{1, 2, {{"transformer.wte.weight", {p->begin(), p->end()}}, {"", {}}}};
    }
    case 14: {
      engine::trace::event a{engine::trace::event_kind::span, 3, "compute", "F", 12.5, 3.25};
      a.step = 1, a.micro_batch = 2, a.stage = 3, a.bytes = 1 << 20;
      engine::trace::event b{engine::trace::event_kind::flow_out, 1, "flow", "micro-batch", 1e9};
      b.flow_id = (1ull << 53) - 1;
      engine::trace::event c{engine::trace::event_kind::instant, 0, "", "stage 1 · dp 0", -0.0};
      return trace_batch{{a, b, c, {}}};
    }
    case 15: return step_report{{7, 600, 2.5, 2.75, 1e-3, 0.9, 1234.5, 80.25, 12.5, 4096, 3e9}};
    case 16: return heartbeat{3, ~0ull};
    case 17: return actor_down{0xfffffffeu, "stage 2 · dp 0 stopped: out of memory"};
    case 18: return error_report{2, "wire: link_message.data: missing payload"};
    case 19: return job_shutdown{false, "rank 3 lost"};
    case 20: return ring_chunk{4, 1, 3, 2, 1, 5, floats(64, 4)};
    default: return checkpoint_chunk{9, "step_9/rank_1.bin", 1ull << 40, 0x0123456789abcdefull,
                                     floats(7, 5)};
  }
}

void check_header(const link_header& a, const link_header& b) {
  CHECK(a.kind == b.kind);
  CHECK(a.step == b.step);
  CHECK(a.round == b.round);
  CHECK(a.micro_batch == b.micro_batch);
  CHECK(a.stage == b.stage);
  CHECK(a.replica == b.replica);
  CHECK(a.eval == b.eval);
  CHECK(a.shape == b.shape);
}
bool same_double(double a, double b) { return std::memcmp(&a, &b, sizeof a) == 0; }

// Field by field: `want` was sent, `got` was decoded.
struct checker {
  const body& got;
  template <class T>
  const T& as() const {
    REQUIRE(std::holds_alternative<T>(got));
    return std::get<T>(got);
  }
  void operator()(const link_message& w) {
    const auto& g = as<link_message>();
    check_header(w.header, g.header);
    check_payload(w.data, g.data);
    CHECK(w.flow_id == g.flow_id);
  }
  void operator()(const link_credit& w) { check_header(w.header, as<link_credit>().header); }
  void operator()(const batch_message& w) {
    const auto& g = as<batch_message>();
    CHECK(std::tie(w.part, w.step, w.round, w.micro_batch, w.replica, w.eval, w.B, w.T,
                   w.flow_id) == std::tie(g.part, g.step, g.round, g.micro_batch, g.replica,
                                          g.eval, g.B, g.T, g.flow_id));
    check_payload(w.tokens, g.tokens);
  }
  void operator()(const batch_credit& w) {
    CHECK(std::tie(w.part, w.replica) == std::tie(as<batch_credit>().part, as<batch_credit>().replica));
  }
  void operator()(const step_plan& w) {
    const auto& g = as<step_plan>();
    CHECK(std::tie(w.step, w.rounds, w.eval) == std::tie(g.step, g.rounds, g.eval));
    REQUIRE(g.plan);
    CHECK(g.plan->name == w.plan->name);
    CHECK(g.plan->shape.ranks == w.plan->shape.ranks);
    CHECK(g.plan->shape.micro_batches == w.plan->shape.micro_batches);
    CHECK(g.plan->shape.virtual_stages == w.plan->shape.virtual_stages);
    CHECK(g.plan->split_backward == w.plan->split_backward);
    CHECK(g.plan->ranks == w.plan->ranks);
  }
  void operator()(const begin_step& w) {
    CHECK(std::tie(w.step, w.rounds) == std::tie(as<begin_step>().step, as<begin_step>().rounds));
  }
  void operator()(const begin_eval& w) {
    CHECK(std::tie(w.step, w.batches) ==
          std::tie(as<begin_eval>().step, as<begin_eval>().batches));
  }
  void operator()(const grads_ready& w) {
    const auto& g = as<grads_ready>();
    CHECK(std::tie(w.step, w.rank, w.replica, w.losses) ==
          std::tie(g.step, g.rank, g.replica, g.losses));
    CHECK(same_double(w.grad_square_sum, g.grad_square_sum));
    CHECK(same_double(w.loss_sum, g.loss_sum));
  }
  void operator()(const apply_update& w) {
    CHECK(w.step == as<apply_update>().step);
    CHECK(same_double(w.grad_norm, as<apply_update>().grad_norm));
  }
  void operator()(const update_done& w) {
    const auto& g = as<update_done>();
    CHECK(std::tie(w.step, w.rank, w.replica) == std::tie(g.step, g.rank, g.replica));
    CHECK(same_double(w.lr, g.lr));
  }
  void operator()(const eval_done& w) {
    const auto& g = as<eval_done>();
    CHECK(std::tie(w.step, w.replica, w.losses) == std::tie(g.step, g.replica, g.losses));
    CHECK(same_double(w.loss_sum, g.loss_sum));
  }
  void operator()(const tied_grad& w) {
    const auto& g = as<tied_grad>();
    CHECK(std::tie(w.step, w.replica) == std::tie(g.step, g.replica));
    check_payload(w.data, g.data);
  }
  void operator()(const snapshot_request&) { as<snapshot_request>(); }
  void operator()(const stage_snapshot& w) {
    const auto& g = as<stage_snapshot>();
    CHECK(std::tie(w.rank, w.replica) == std::tie(g.rank, g.replica));
    REQUIRE(g.parameters.size() == w.parameters.size());
    for (std::size_t i = 0; i < w.parameters.size(); ++i) {
      const auto& [wn, wv] = w.parameters[i];
      const auto& [gn, gv] = g.parameters[i];
      CHECK(wn == gn);
      CHECK(same_bits(wv.data(), wv.size(), gv.data(), gv.size()));
    }
  }
  void operator()(const trace_batch& w) {
    const auto& g = as<trace_batch>();
    REQUIRE(g.events.size() == w.events.size());
    for (std::size_t i = 0; i < w.events.size(); ++i) {
      const auto& a = w.events[i];
      const auto& b = g.events[i];
      CHECK(std::tie(a.kind, a.track, a.category, a.name, a.flow_id, a.step, a.micro_batch,
                     a.stage, a.bytes) == std::tie(b.kind, b.track, b.category, b.name,
                                                   b.flow_id, b.step, b.micro_batch, b.stage,
                                                   b.bytes));
      CHECK(same_double(a.ts_us, b.ts_us));
      CHECK(same_double(a.dur_us, b.dur_us));
    }
  }
  void operator()(const step_report& w) {
    const auto& a = w.metrics;
    const auto& b = as<step_report>().metrics;
    CHECK(std::tie(a.step, a.total_steps, a.tokens, a.val_loss) ==
          std::tie(b.step, b.total_steps, b.tokens, b.val_loss));
    for (auto f : {&engine::step_metrics::loss, &engine::step_metrics::lr,
                   &engine::step_metrics::grad_norm, &engine::step_metrics::tokens_per_s,
                   &engine::step_metrics::step_ms, &engine::step_metrics::elapsed_s,
                   &engine::step_metrics::flops_per_s})
      CHECK(same_double(a.*f, b.*f));
  }
  void operator()(const heartbeat& w) {
    CHECK(std::tie(w.rank, w.sequence) ==
          std::tie(as<heartbeat>().rank, as<heartbeat>().sequence));
  }
  void operator()(const actor_down& w) {
    CHECK(std::tie(w.actor, w.reason) == std::tie(as<actor_down>().actor, as<actor_down>().reason));
  }
  void operator()(const error_report& w) {
    CHECK(std::tie(w.rank, w.message) ==
          std::tie(as<error_report>().rank, as<error_report>().message));
  }
  void operator()(const job_shutdown& w) {
    CHECK(std::tie(w.ok, w.message) ==
          std::tie(as<job_shutdown>().ok, as<job_shutdown>().message));
  }
  void operator()(const ring_chunk& w) {
    const auto& g = as<ring_chunk>();
    CHECK(std::tie(w.step, w.rank, w.bucket, w.from_replica, w.phase, w.chunk) ==
          std::tie(g.step, g.rank, g.bucket, g.from_replica, g.phase, g.chunk));
    check_payload(w.data, g.data);
  }
  void operator()(const checkpoint_chunk& w) {
    const auto& g = as<checkpoint_chunk>();
    CHECK(std::tie(w.step, w.file, w.offset, w.xxhash) ==
          std::tie(g.step, g.file, g.offset, g.xxhash));
    check_payload(w.data, g.data);
  }
};

// The tensor payloads a message holds.
std::vector<const void*> payload_pointers(const body& b) {
  std::vector<const void*> out;
  std::visit(
      [&out](const auto& m) {
        using M = std::decay_t<decltype(m)>;
        if constexpr (requires { m.data; }) out.push_back(m.data->data());
        if constexpr (std::is_same_v<M, batch_message>) out.push_back(m.tokens->data());
      },
      b);
  return out;
}

}  // namespace

TEST_CASE("every message kind round-trips field by field, payloads bit-exact", "[unit]") {
  const std::size_t kind = GENERATE(range(std::size_t{0}, std::variant_size_v<body>));
  const envelope sent{0x80000001u, 5, 0xfedcba9876543210ull, kind % 2 == 1, sample(kind)};
  CAPTURE(kind_name(sent.message));
  const frame f = encode(sent);
  auto buf = gather(f);
  const envelope got = decode(buf, f.bytes, wide());
  CHECK(got.target == sent.target);
  CHECK(got.source_rank == sent.source_rank);
  CHECK(got.correlation == sent.correlation);
  CHECK(got.reply == sent.reply);
  CHECK(kind_name(got.message) == kind_name(sent.message));
  std::visit(checker{got.message}, sent.message);

  // Zero copies: the iov references each payload itself; decoded payloads point into buf.
  for (const void* p : payload_pointers(sent.message)) {
    CHECK(std::count_if(f.iov.begin(), f.iov.end(),
                        [p](const auto& entry) { return entry.first == p; }) == 1);
  }
  for (const void* p : payload_pointers(got.message)) {
    CHECK(p >= static_cast<const void*>(buf->data()));
    CHECK(p < static_cast<const void*>(buf->data() + f.bytes));
  }
}

TEST_CASE("kind names follow the C++ struct names", "[unit]") {
  CHECK(kind_name(body{heartbeat{}}) == "heartbeat");
  CHECK(kind_name(body{link_message{}}) == "link_message");
  CHECK(kind_name(body{checkpoint_chunk{}}) == "checkpoint_chunk");
  CHECK(kind_name(body{snapshot_request{}}) == "snapshot_request");
}

TEST_CASE("a step report without a validation loss keeps it absent", "[unit]") {
  const auto got = round_trip({0, 0, 0, false, step_report{{3, 10, 1.5, std::nullopt}}});
  CHECK_FALSE(std::get<step_report>(got.message).metrics.val_loss.has_value());
}

TEST_CASE("decoded payloads keep the receive buffer alive", "[unit]") {
  const auto sent = floats(100, 9);
  const frame f = encode({1, 0, 0, false, tied_grad{1, 0, sent}});
  auto buf = gather(f);
  auto got = std::get<tied_grad>(decode(buf, f.bytes, wide()).message).data;
  buf.reset();  // the view alone owns the buffer now (ASan would see a use after free)
  CHECK(same_bits(sent->data(), sent->size(), got->data(), got->size()));
}

TEST_CASE("a frame stays valid after the message is dropped", "[unit]") {
  auto data = floats(1000, 11);
  const std::vector<float> expect(data->begin(), data->end());
  const float* bytes_of_payload = data->data();
  auto e = std::make_unique<envelope>(
      envelope{4, 1, 0, false, link_message{header(link_kind::activation, {1, 10, 100}), data, 1}});
  data.reset();
  const frame f = encode(*e);
  e.reset();  // the message and its last handle on the payload are gone; `keep` still holds it
  CHECK(std::any_of(f.iov.begin(), f.iov.end(),
                    [&](const auto& entry) { return entry.first == bytes_of_payload; }));
  const auto got = std::get<link_message>(decode(gather(f), f.bytes, wide()).message);
  CHECK(same_bits(expect.data(), expect.size(), got.data->data(), got.data->size()));
}

TEST_CASE("payloads of odd sizes and misaligned views are sent exactly", "[unit]") {
  SECTION("a size that is not a multiple of 8 bytes is padded with zeros, never over-read") {
    const auto data = floats(3, 12);
    const frame f = encode({0, 0, 0, false, tied_grad{0, 0, data}});
    const auto it = std::find_if(f.iov.begin(), f.iov.end(),
                                 [&](const auto& e) { return e.first == data->data(); });
    REQUIRE(it != f.iov.end());
    CHECK(it->second == 12);
    REQUIRE(std::next(it) != f.iov.end());
    CHECK(std::next(it)->second == 4);
    CHECK(*static_cast<const std::uint32_t*>(std::next(it)->first) == 0);
    checker{decode(gather(f), f.bytes, wide()).message}(tied_grad{0, 0, data});
  }
  SECTION("a view one float into a buffer is copied once into the frame") {
    const auto base = floats(9, 13);
    const auto view = std::make_shared<payload<float>>(base, base->data() + 1, 8);
    const auto got = round_trip({0, 0, 0, false, tied_grad{0, 0, view}});
    checker{got.message}(tied_grad{0, 0, view});
  }
  SECTION("an empty payload is an empty view") {
    const auto got = round_trip({0, 0, 0, false, tied_grad{0, 0, floats(0, 0)}});
    CHECK(std::get<tied_grad>(got.message).data->size() == 0);
  }
}

TEST_CASE("payloads larger than a piece travel as consecutive pieces, read as one view",
          "[unit]") {
  const std::size_t n = GENERATE(1000, 1001, 16);
  const auto data = floats(n, 14);
  const envelope sent{0, 0, 0, false, ring_chunk{1, 0, 0, 1, 0, 0, data}};
  const frame f = detail::encode(sent, 64);
  const auto* first = reinterpret_cast<const std::byte*>(data->data());
  std::size_t pieces = 0;
  for (const auto& [p, len] : f.iov) {
    const auto* at = static_cast<const std::byte*>(p);
    if (at < first || at >= first + n * 4) continue;
    CHECK(at == first + 64 * pieces);  // referenced in place, in order
    ++pieces;
  }
  CHECK(pieces == (n * 4 + 63) / 64);
  auto buf = gather(f);
  const auto got = std::get<ring_chunk>(decode(buf, f.bytes, wide()).message);
  check_payload(data, got.data);
  const auto tok = tokens(999);
  const frame t = detail::encode({0, 0, 0, false, batch_message{{}, 0, 0, 0, 0, false, 27, 37, tok}}, 8);
  check_payload(tok, std::get<batch_message>(decode(gather(t), t.bytes, wide()).message).tokens);
  CHECK_THAT(refusal([&] { detail::encode(sent, 12); }), Catch::Contains("multiple of 8"));
}

TEST_CASE("a payload over 2^29 bytes crosses as two pieces and one view", "[unit][large]") {
  const std::size_t n = (std::size_t{1} << 27) + 4096;  // 2^29 + 16 KiB bytes
  auto data = std::make_shared<payload<float>>(n);
  for (std::size_t i = 0; i < n; ++i) {
    const auto bits = static_cast<std::uint32_t>(i * 2654435761u);
    std::memcpy(data->data() + i, &bits, 4);
  }
  const frame f = encode({0, 0, 0, false, tied_grad{1, 0, data}});
  const auto* first = reinterpret_cast<const std::byte*>(data->data());
  CHECK(std::count_if(f.iov.begin(), f.iov.end(), [&](const auto& e) {
          return e.first == first || e.first == first + detail::max_piece_bytes;
        }) == 2);
  limits lim = wide();
  lim.max_tensor_elements = n;
  const auto got = std::get<tied_grad>(decode(gather(f), f.bytes, lim).message);
  check_payload(data, got.data);
}

TEST_CASE("encode refuses messages without their payload or plan", "[unit]") {
  CHECK_THAT(refusal([] { encode({0, 0, 0, false, link_message{}}); }),
             Catch::Contains("link_message.data: null payload"));
  CHECK_THAT(refusal([] { encode({0, 0, 0, false, step_plan{}}); }),
             Catch::Contains("step_plan.plan: null plan"));
}
