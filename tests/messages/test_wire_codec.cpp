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
std::string refused_with(const std::function<void()>& f) {
  try {
    f();
  } catch (const wire_error& e) {
    return e.what();
  } catch (const std::exception& e) {
    return std::string("<not a wire_error: ") + e.what() + ">";
  }
  return "<no exception thrown>";
}
std::string refused_with(const frame& f, const limits& lim = wide()) {
  return refused_with([&] { decode(gather(f), f.bytes, lim); });
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
                           engine::make_plan("zb_h1", engine::schedule_shape{2, 4, 1}))};
    case 5:
      return begin_step{8, 3};
    case 6:
      return begin_eval{100, 16};
    case 7:
      return grads_ready{4, 1, 2, 0.125, -1e300, 4};
    case 8:
      return apply_update{5, 3.5e-7};
    case 9:
      return update_done{5, 1, 0, 2e-3};
    case 10:
      return eval_done{6, 1, 12.75, 8};
    case 11:
      return tied_grad{6, 1, floats(33, 2)};
    case 12:
      return snapshot_request{};
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
    case 15:
      return step_report{{7, 600, 2.5, 2.75, 1e-3, 0.9, 1234.5, 80.25, 12.5, 4096, 3e9}};
    case 16:
      return heartbeat{3, ~0ull};
    case 17:
      return actor_down{0xfffffffeu, "stage 2 · dp 0 stopped: out of memory"};
    case 18:
      return error_report{2, "wire: link_message.data: missing payload"};
    case 19:
      return job_shutdown{false, "rank 3 lost"};
    case 20:
      return ring_chunk{4, 1, 3, 2, 1, 5, floats(64, 4)};
    default:
      return checkpoint_chunk{9, "step_9/rank_1.bin", 1ull << 40, 0x0123456789abcdefull,
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
    CHECK(
        std::tie(w.part, w.step, w.round, w.micro_batch, w.replica, w.eval, w.B, w.T, w.flow_id) ==
        std::tie(g.part, g.step, g.round, g.micro_batch, g.replica, g.eval, g.B, g.T, g.flow_id));
    check_payload(w.tokens, g.tokens);
  }
  void operator()(const batch_credit& w) {
    CHECK(std::tie(w.part, w.replica) ==
          std::tie(as<batch_credit>().part, as<batch_credit>().replica));
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
    CHECK(std::tie(w.step, w.batches) == std::tie(as<begin_eval>().step, as<begin_eval>().batches));
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
      CHECK(std::tie(a.kind, a.track, a.category, a.name, a.flow_id, a.step, a.micro_batch, a.stage,
                     a.bytes) == std::tie(b.kind, b.track, b.category, b.name, b.flow_id, b.step,
                                          b.micro_batch, b.stage, b.bytes));
      CHECK(same_double(a.ts_us, b.ts_us));
      CHECK(same_double(a.dur_us, b.dur_us));
    }
  }
  void operator()(const step_report& w) {
    const auto& a = w.metrics;
    const auto& b = as<step_report>().metrics;
    CHECK(std::tie(a.step, a.total_steps, a.tokens, a.val_loss) ==
          std::tie(b.step, b.total_steps, b.tokens, b.val_loss));
    for (auto f :
         {&engine::step_metrics::loss, &engine::step_metrics::lr, &engine::step_metrics::grad_norm,
          &engine::step_metrics::tokens_per_s, &engine::step_metrics::step_ms,
          &engine::step_metrics::elapsed_s, &engine::step_metrics::flops_per_s})
      CHECK(same_double(a.*f, b.*f));
  }
  void operator()(const heartbeat& w) {
    CHECK(std::tie(w.rank, w.sequence) == std::tie(as<heartbeat>().rank, as<heartbeat>().sequence));
  }
  void operator()(const actor_down& w) {
    CHECK(std::tie(w.actor, w.reason) == std::tie(as<actor_down>().actor, as<actor_down>().reason));
  }
  void operator()(const error_report& w) {
    CHECK(std::tie(w.rank, w.message) ==
          std::tie(as<error_report>().rank, as<error_report>().message));
  }
  void operator()(const job_shutdown& w) {
    CHECK(std::tie(w.ok, w.message) == std::tie(as<job_shutdown>().ok, as<job_shutdown>().message));
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
    const frame f = encode({0, 0, 0, false, tied_grad{0, 0, view}});
    CHECK(std::none_of(f.iov.begin(), f.iov.end(),
                       [&](const auto& e) { return e.first == view->data(); }));
    checker{decode(gather(f), f.bytes, wide()).message}(tied_grad{0, 0, view});
  }
  SECTION("an empty payload is an empty view") {
    const auto got = round_trip({0, 0, 0, false, tied_grad{0, 0, floats(0, 0)}});
    CHECK(std::get<tied_grad>(got.message).data->size() == 0);
  }
}

TEST_CASE("payloads larger than a piece travel as consecutive pieces, read as one view", "[unit]") {
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
  const frame t =
      detail::encode({0, 0, 0, false, batch_message{{}, 0, 0, 0, 0, false, 27, 37, tok}}, 8);
  check_payload(tok, std::get<batch_message>(decode(gather(t), t.bytes, wide()).message).tokens);
  CHECK_THAT(refused_with([&] { detail::encode(sent, 12); }), Catch::Contains("multiple of 8"));
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
  CHECK_THAT(refused_with([] {
               encode({0, 0, 0, false, link_message{}});
             }),
             Catch::Contains("link_message.data: null payload"));
  CHECK_THAT(refused_with([] {
               encode({0, 0, 0, false, step_plan{}});
             }),
             Catch::Contains("step_plan.plan: null plan"));
}

namespace {

// Cap'n Proto encoding: a struct pointer word has type 0 in bits 0-1, a signed offset in words
// from the next word in bits 2-31, data words in bits 32-47 (pointers follow the data words).
struct struct_at {
  std::byte* data = nullptr;
  std::uint16_t data_words = 0;
  std::byte* pointer(int i) const { return data + 8 * data_words + 8 * i; }
};
std::uint64_t word_at(const std::byte* at) {
  std::uint64_t w = 0;
  std::memcpy(&w, at, 8);
  return w;
}
std::byte* target_of(std::byte* pointer) {
  const auto offset = static_cast<std::int32_t>(static_cast<std::uint32_t>(word_at(pointer))) >> 2;
  return pointer + 8 + 8 * std::int64_t{offset};
}
struct_at follow(std::byte* pointer) {
  const std::uint64_t w = word_at(pointer);
  REQUIRE(w != 0);
  REQUIRE((w & 3) == 0);
  return {target_of(pointer), static_cast<std::uint16_t>(w >> 32)};
}
// The Envelope: segment 0 starts after the table; its first word is the root pointer.
// Data section: schema bytes 0-7, version 8-11, target 12-15, body union tag 22-23.
struct_at root_of(aligned_buffer& buf) {
  std::uint32_t n = 0;
  std::memcpy(&n, buf.data(), 4);
  return follow(buf.data() + (std::size_t{n} + 2) / 2 * 8);
}
template <class T>
void poke(std::byte* at, T value) {
  std::memcpy(at, &value, sizeof value);
}

}  // namespace

TEST_CASE("oversized, truncated, padded and misaligned frames are refused", "[unit]") {
  const envelope e{0, 0, 0, false,
                   link_message{header(link_kind::activation, {4, 25}), floats(100, 21), 1}};
  const frame f = encode(e);
  SECTION("a frame over max_frame_bytes") {
    limits lim = wide();
    lim.max_frame_bytes = f.bytes - 1;
    CHECK(refused_with(f, lim) == "wire: frame: " + std::to_string(f.bytes) +
                                      " bytes exceed max_frame_bytes " +
                                      std::to_string(f.bytes - 1));
  }
  SECTION("a frame truncated at several cut points") {
    auto buf = gather(f);
    const std::size_t table = f.iov[0].second, seg0 = f.iov[1].second;
    for (const std::size_t cut : {std::size_t{0}, std::size_t{4}, std::size_t{7}, table, table + 8,
                                  table + seg0 / 2, table + seg0, f.bytes - 200, f.bytes - 1}) {
      CAPTURE(cut);
      CHECK_THAT(refused_with([&] { decode(buf, cut, wide()); }),
                 Catch::StartsWith("wire: frame: truncated: "));
    }
  }
  SECTION("bytes after the last segment, or more bytes than the buffer holds") {
    auto buf = gather(f, 0, 8);
    CHECK(refused_with([&] { decode(buf, f.bytes + 8, wide()); }) ==
          "wire: frame: 8 bytes after the last segment");
    CHECK_THAT(refused_with([&] { decode(buf, f.bytes + 16, wide()); }),
               Catch::Contains("bytes in a buffer of"));
  }
  SECTION("a frame 4 bytes into its buffer") {
    auto buf = gather(f, 4);
    CHECK_THAT(refused_with([&] { detail::decode(buf, buf->data() + 4, f.bytes, wide()); }),
               Catch::StartsWith("wire: frame: unaligned buffer"));
  }
}

TEST_CASE("tensors, lists, shapes and plans beyond the limits or the payload are refused",
          "[unit]") {
  limits lim = wide();
  SECTION("a tensor over max_tensor_elements") {
    lim.max_tensor_elements = 99;
    const frame f = encode(
        {0, 0, 0, false, link_message{header(link_kind::activation, {100}), floats(100, 1)}});
    CHECK(refused_with(f, lim) ==
          "wire: link_message.data: 100 elements exceed max_tensor_elements 99");
  }
  SECTION("lists over max_list_elements") {
    lim.max_list_elements = 3;
    CHECK(refused_with(encode({0, 0, 0, false, trace_batch{std::vector<engine::trace::event>(4)}}),
                       lim) ==
          "wire: trace_batch.events: list of 4 elements exceeds max_list_elements 3");
    CHECK(refused_with(
              encode({0, 0, 0, false, link_credit{header(link_kind::gradient, {1, 1, 1, 1})}}),
              lim) ==
          "wire: link_credit.header.shape: list of 4 elements exceeds max_list_elements 3");
    const stage_snapshot snap{0, 0, {{"a", {}}, {"b", {}}, {"c", {}}, {"d", {}}}};
    CHECK_THAT(refused_with(encode({0, 0, 0, false, snap}), lim),
               Catch::StartsWith("wire: stage_snapshot.parameters: list of 4 elements"));
    const auto plan = std::make_shared<const engine::pipeline_plan>(
        engine::make_plan("gpipe", engine::schedule_shape{2, 4, 1}));
    lim.max_list_elements = 7;  // 2 ranks x 4 micro-batches = 8
    CHECK_THAT(refused_with(encode({0, 0, 0, false, step_plan{1, 1, false, plan}}), lim),
               Catch::StartsWith("wire: step_plan.plan: shape 2 ranks x 1 virtual stages x 4 "
                                 "micro-batches is empty or over max_list_elements"));
  }
  SECTION("a shape whose product disagrees with the payload") {
    CHECK(refused_with(
              encode({0, 0, 0, false,
                      link_message{header(link_kind::activation, {2, 3, 4}), floats(25, 1)}})) ==
          "wire: link_message.header.shape: shape holds 24 elements, the payload 25");
    CHECK_THAT(refused_with(
                   encode({0, 0, 0, false,
                           link_message{header(link_kind::activation, {-5, -5}), floats(25, 1)}})),
               Catch::Contains("link_message.header.shape: shape dimension -5 is negative"));
    CHECK(refused_with(
              encode({0, 0, 0, false,
                      batch_message{batch_part::inputs, 0, 0, 0, 0, false, 2, 3, tokens(7)}})) ==
          "wire: batch_message.B x T: shape holds 6 elements, the payload 7");
  }
  SECTION("an unknown enum value") {
    auto h = header(static_cast<link_kind>(9), {1});
    CHECK(refused_with(encode({0, 0, 0, false, link_message{h, floats(1, 1)}})) ==
          "wire: link_message.header: unknown enum value 9");
  }
  SECTION("a plan that does not pass check_plan") {
    auto plan = engine::make_plan("1f1b", engine::schedule_shape{2, 4, 1});
    plan.ranks[1].pop_back();
    const frame f =
        encode({0, 0, 0, false,
                step_plan{1, 1, false, std::make_shared<const engine::pipeline_plan>(plan)}});
    CHECK_THAT(refused_with(f),
               Catch::StartsWith("wire: step_plan.plan: does not pass check_plan: ") &&
                   Catch::Contains("missing"));
  }
  SECTION("a plan nested deeper than max_nesting") {
    lim.max_nesting = 2;
    CHECK_THAT(refused_with(encode({0, 0, 0, false, sample(4)}), lim),
               Catch::StartsWith("wire: step_plan.plan: malformed frame: ") &&
                   Catch::Contains("too deeply-nested"));
  }
}

TEST_CASE("frames of another schema or version, or of an unknown kind, are refused", "[unit]") {
  const frame f = encode({0x01020304u, 0, 0, false, heartbeat{1, 2}});
  auto buf = gather(f);
  const auto root = root_of(*buf);
  REQUIRE(word_at(root.data + 8) >> 32 == 0x01020304u);  // the target: the layout is as assumed
  SECTION("another protocol version") {
    poke<std::uint32_t>(root.data + 8, protocol_version + 1);
    CHECK(refused_with([&] { decode(buf, f.bytes, wide()); }) ==
          "wire: heartbeat: protocol version " + std::to_string(protocol_version + 1) +
              ", this process speaks version " + std::to_string(protocol_version));
  }
  SECTION("another schema id") {
    poke<std::uint64_t>(root.data, 42);
    CHECK_THAT(refused_with([&] { decode(buf, f.bytes, wide()); }),
               Catch::StartsWith("wire: frame: schema id 42 is not the wire schema "));
  }
  SECTION("an unknown message kind") {
    poke<std::uint16_t>(root.data + 22, 40);
    CHECK(refused_with([&] { decode(buf, f.bytes, wide()); }) ==
          "wire: frame: unknown message kind 40");
  }
}

TEST_CASE("a missing or scattered payload is refused", "[unit]") {
  const envelope e{0, 0, 0, false, link_message{header(link_kind::activation, {5}), floats(5, 1)}};
  const frame f = detail::encode(e, 16);  // pieces of 16 and 4 bytes
  auto buf = gather(f);
  const auto message = follow(root_of(*buf).pointer(0));  // LinkMessage: header, data
  SECTION("no payload") {
    poke<std::uint64_t>(message.pointer(1), 0);
    CHECK(refused_with([&] { decode(buf, f.bytes, wide()); }) ==
          "wire: link_message.data: missing payload");
  }
  SECTION("pieces out of order") {
    std::byte* list = target_of(follow(message.pointer(1)).pointer(0));  // Tensor.pieces
    std::swap_ranges(list, list + 8, list + 8);
    CHECK(refused_with([&] { decode(buf, f.bytes, wide()); }) ==
          "wire: link_message.data: piece 1 does not follow the one before in the frame");
  }
}

TEST_CASE("random and mutated frames are refused with a wire_error, never a crash", "[unit]") {
  std::mt19937_64 rng(20240601);
  for (int i = 0; i < 300; ++i) {
    const std::size_t n = 8 * (1 + rng() % 64);
    auto buf = aligned_buffer::make(n);
    for (std::size_t j = 0; j < n; j += 8) poke(buf->data() + j, rng());
    if (i % 2 == 1) {  // a plausible table, so that Cap'n Proto parses the random words
      poke<std::uint32_t>(buf->data(), 0);
      poke<std::uint32_t>(buf->data() + 4, static_cast<std::uint32_t>(n / 8 - 1));
    }
    CAPTURE(i);
    CHECK_THROWS_AS(decode(buf, n, wide()), wire_error);
  }
  // Valid frames of every kind with a few bytes of the table and segment 0 changed: each either
  // decodes or is a wire_error (any other exception fails the test; a crash fails ASan).
  int refused = 0;
  for (int i = 0; i < 440; ++i) {
    const frame f = encode({0, 0, 0, false, sample(static_cast<std::size_t>(i) % 22)});
    auto buf = gather(f);
    const std::size_t head = f.iov[0].second + f.iov[1].second;
    for (int k = 0; k <= i % 4; ++k)
      buf->data()[rng() % head] ^= static_cast<std::byte>(1 + rng() % 255);
    try {
      decode(buf, f.bytes, wide());
    } catch (const wire_error&) {
      ++refused;
    }
  }
  CHECK(refused > 100);
}

TEST_CASE("limits_for the default recipe admits what the recipe sends, nothing larger", "[unit]") {
  const auto r = engine::load_recipe(TROUPE_SOURCE_DIR "/examples/default.toml", {});
  const limits lim = limits_for(r);
  const std::size_t B = 2, T = 128, C = 256, Vp = 256;  // examples/default.toml
  REQUIRE(std::tie(r.batch.micro_batch, r.model.context, r.model.width,
                   r.model.padded_vocab_size) == std::tie(B, T, C, Vp));
  // dp = 1, no ring: the largest tensor is the largest parameter, mlp.c_fc.weight [4C, C].
  CHECK(lim.max_tensor_elements == 4 * C * C);
  CHECK(lim.max_nesting == 16);
  const auto activation = floats(B * T * C, 1);
  round_trip(
      {0, 0, 0, false, link_message{header(link_kind::activation, {2, 128, 256}), activation}},
      lim);
  round_trip({0, 0, 0, false, tied_grad{0, 0, floats(Vp * C, 2)}}, lim);
  round_trip({0, 0, 0, false, tied_grad{0, 0, floats(lim.max_tensor_elements, 3)}}, lim);
  CHECK_THAT(
      refused_with(
          encode({0, 0, 0, false, tied_grad{0, 0, floats(lim.max_tensor_elements + 1, 4)}}), lim),
      Catch::Contains("tied_grad.data: 262145 elements exceed max_tensor_elements 262144"));

  // The recipe's plan, a whole rank's parameters and a stage's trace events of a step fit.
  const auto& p = r.parallel;
  round_trip({0, 0, 0, false,
              step_plan{1, 1, false,
                        std::make_shared<const engine::pipeline_plan>(engine::make_plan(
                            p.schedule, {p.pp, p.micro_batches, p.virtual_stages}))}},
             lim);
  const auto layout = engine::make_pipeline_layout(r.model, p.pp, p.virtual_stages);
  stage_snapshot snap;
  for (const auto& param : engine::stage_parameter_layout(r.model, layout.rank_chunks(0).at(0)))
    snap.parameters.emplace_back(param.name,
                                 std::vector<float>(static_cast<std::size_t>(param.numel)));
  round_trip({0, 0, 0, false, snap}, lim);
  engine::trace::event span{engine::trace::event_kind::span, 1, "compute", "F", 1.0, 2.0};
  const auto per_step = static_cast<std::size_t>(8 * 3 * p.micro_batches * p.virtual_stages);
  round_trip({0, 0, 0, false, trace_batch{std::vector<engine::trace::event>(per_step, span)}}, lim);
}

TEST_CASE("limits_for with data parallelism admits a ring chunk of the largest bucket", "[unit]") {
  const std::uint64_t C = 256, block = 12 * C * C + 13 * C;  // one transformer block's gradients
  const auto path = TROUPE_SOURCE_DIR "/examples/default.toml";
  CHECK(limits_for(engine::load_recipe(path, {"parallel.dp=2"})).max_tensor_elements == block);
  CHECK(limits_for(engine::load_recipe(path, {"parallel.dp=2", "parallel.bucket_layers=2"}))
            .max_tensor_elements == 2 * block);
}

TEST_CASE("evaluation plans (forward only) cross; other forward-only plans are refused", "[unit]") {
  engine::pipeline_plan p;
  p.name = "forward-only";
  p.shape = {2, 3, 2};  // 2 ranks, 3 micro-batches, 2 chunks
  p.ranks.resize(2);
  for (int r = 0; r < 2; ++r)
    for (int j = 0; j < 3; ++j)
      for (int c = 0; c < 2; ++c)
        p.ranks[static_cast<std::size_t>(r)].push_back(
            {engine::action_kind::forward, c * 2 + r, j});
  auto plan = std::make_shared<const engine::pipeline_plan>(p);
  const auto got = round_trip({5, 0, 0, false, step_plan{4, 1, true, plan}});
  const auto& sp = std::get<step_plan>(got.message);
  REQUIRE(sp.eval);
  REQUIRE(sp.plan->ranks[0].size() == 6);
  REQUIRE(engine::format_plan(*sp.plan) == engine::format_plan(p));
  // The same actions as a training plan fail the simulator's check (no backward).
  REQUIRE_THAT(refused_with(encode({5, 0, 0, false, step_plan{4, 1, false, plan}})),
               Catch::Contains("check_plan"));
  // A forward-only plan missing a forward, or with a forward on the wrong rank, is refused.
  auto missing = p;
  missing.ranks[1].pop_back();
  REQUIRE_THAT(
      refused_with(
          encode({5, 0, 0, false,
                  step_plan{4, 1, true, std::make_shared<const engine::pipeline_plan>(missing)}})),
      Catch::Contains("expected 6"));
  auto wrong = p;
  wrong.ranks[0][0].stage = 1;
  REQUIRE_THAT(refused_with(encode(
                   {5, 0, 0, false,
                    step_plan{4, 1, true, std::make_shared<const engine::pipeline_plan>(wrong)}})),
               Catch::Contains("rank 0 has action"));
}
