// The wire codec, round trips: every message kind round-trips field by field with bit-equal
// payloads; payloads are referenced on send (the iov points at the payload) and viewed on
// receive (no copy); large payloads split into pieces and come back as one view; evaluation plans
// cross. Refusals and limits: test_wire_refusals.cpp.
#include <catch2/catch.hpp>

#include <cstring>
#include <functional>
#include <random>

#include "engine/parallel/pipeline_layout.hpp"
#include "engine/parallel/schedule.hpp"
#include "messages/wire_codec.hpp"
#include "tests/messages/wire_test_util.hpp"

using namespace troupe::messages;
using namespace troupe::messages::wire;
using namespace wire_test;
namespace engine = troupe::engine;

namespace {

void check_header(const link_header& a, const link_header& b) {
  CHECK(a.kind == b.kind);
  CHECK(a.step == b.step);
  CHECK(a.round == b.round);
  CHECK(a.micro_batch == b.micro_batch);
  CHECK(a.virtual_stage == b.virtual_stage);
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
    CHECK(same_double(w.loss_scale, g.loss_scale));
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
    CHECK(same_double(w.loss_scale, as<begin_step>().loss_scale));
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
    CHECK(w.skip == as<apply_update>().skip);
    CHECK(same_double(w.unscale, as<apply_update>().unscale));
  }
  void operator()(const update_done& w) {
    const auto& g = as<update_done>();
    CHECK(std::tie(w.step, w.rank, w.replica) == std::tie(g.step, g.rank, g.replica));
    CHECK(same_double(w.lr, g.lr));
    same_memory(w.memory, g.memory);
  }
  static void same_memory(const engine::memory_report& a, const engine::memory_report& b) {
    CHECK(std::tie(a.replica, a.rank, a.parameters, a.gradients, a.optimizer, a.buffers, a.pooled,
                   a.activations) == std::tie(b.replica, b.rank, b.parameters, b.gradients,
                                              b.optimizer, b.buffers, b.pooled, b.activations));
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
  void operator()(const snapshot_request& w) {
    const auto& g = as<snapshot_request>();
    CHECK(std::tie(w.step, w.state, w.capture, w.part_dir) ==
          std::tie(g.step, g.state, g.capture, g.part_dir));
  }
  void operator()(const stage_snapshot& w) {
    const auto& g = as<stage_snapshot>();
    CHECK(std::tie(w.rank, w.replica) == std::tie(g.rank, g.replica));
    CHECK(std::tie(w.part.name, w.part.bytes, w.part.xxh64) ==
          std::tie(g.part.name, g.part.bytes, g.part.xxh64));
    REQUIRE(g.parameters.size() == w.parameters.size());
    for (std::size_t i = 0; i < w.parameters.size(); ++i) {
      const auto& [wn, wv] = w.parameters[i];
      const auto& [gn, gv] = g.parameters[i];
      CHECK(wn == gn);
      CHECK(same_bits(wv.data(), wv.size(), gv.data(), gv.size()));
    }
    REQUIRE(g.pieces.size() == w.pieces.size());
    for (std::size_t i = 0; i < w.pieces.size(); ++i) {
      const auto &wp = w.pieces[i], &gp = g.pieces[i];
      CHECK(std::tie(wp.role, wp.name, wp.offset) == std::tie(gp.role, gp.name, gp.offset));
      CHECK(same_bits(wp.values.data(), wp.values.size(), gp.values.data(), gp.values.size()));
    }
  }
  void operator()(const trace_batch& w) {
    const auto& g = as<trace_batch>();
    REQUIRE(g.events.size() == w.events.size());
    for (std::size_t i = 0; i < w.events.size(); ++i) {
      const auto& a = w.events[i];
      const auto& b = g.events[i];
      CHECK(std::tie(a.kind, a.track, a.category, a.name, a.flow_id, a.step, a.micro_batch,
                     a.virtual_stage, a.bytes) == std::tie(b.kind, b.track, b.category, b.name,
                                                           b.flow_id, b.step, b.micro_batch,
                                                           b.virtual_stage, b.bytes));
      CHECK(same_double(a.ts_us, b.ts_us));
      CHECK(same_double(a.dur_us, b.dur_us));
    }
  }
  void operator()(const step_report& w) {
    const auto& a = w.metrics;
    const auto& b = as<step_report>().metrics;
    CHECK(std::tie(a.step, a.total_steps, a.tokens, a.val_loss, a.skipped, a.loss_scale) ==
          std::tie(b.step, b.total_steps, b.tokens, b.val_loss, b.skipped, b.loss_scale));
    for (auto f :
         {&engine::step_metrics::loss, &engine::step_metrics::lr, &engine::step_metrics::grad_norm,
          &engine::step_metrics::tokens_per_s, &engine::step_metrics::step_ms,
          &engine::step_metrics::elapsed_s, &engine::step_metrics::flops_per_s})
      CHECK(same_double(a.*f, b.*f));
    REQUIRE(a.memory.size() == b.memory.size());
    for (std::size_t i = 0; i < a.memory.size(); ++i) same_memory(a.memory[i], b.memory[i]);
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
    CHECK(std::tie(w.step, w.rank, w.bucket, w.from_replica, w.phase, w.chunk, w.collective) ==
          std::tie(g.step, g.rank, g.bucket, g.from_replica, g.phase, g.chunk, g.collective));
    check_payload(w.data, g.data);
  }
  void operator()(const checkpoint_chunk& w) {
    const auto& g = as<checkpoint_chunk>();
    CHECK(std::tie(w.step, w.file, w.offset, w.xxhash) ==
          std::tie(g.step, g.file, g.offset, g.xxhash));
    check_payload(w.data, g.data);
  }
  void operator()(const tensor_exchange& w) {
    const auto& g = as<tensor_exchange>();
    CHECK(std::tie(w.seq, w.from, w.kind, w.reason) == std::tie(g.seq, g.from, g.kind, g.reason));
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
  CHECK(kind_name(body{tensor_exchange{}}) == "tensor_exchange");
}

TEST_CASE("a step report without a validation loss keeps it absent", "[unit]") {
  const auto got = round_trip(
      {0, 0, 0, false, step_report{{3, 10, 1.5, std::nullopt, 0, 0, 0, 0, 0, 0, 0, {}, {}, {}}}});
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

TEST_CASE("a frame built in recycled memory comes out as if built in fresh memory", "[unit]") {
  // encode reuses the memory of dropped frames (the builder's first segment, the lists). A frame
  // built there must carry no trace of the frame before it, and a frame still held must never be
  // written by a later encode.
  const envelope small{2, 1, 0, false, link_credit{header(link_kind::gradient, {1, 2, 3})}};
  const auto bytes_of = [](const frame& f) {
    const auto b = gather(f);
    return std::vector<std::byte>(b->data(), b->data() + f.bytes);
  };
  const auto reference = bytes_of(encode(small));
  for (std::size_t kind = 0; kind < std::variant_size_v<body>; ++kind) {
    const envelope big{0x80000001u, 5, ~std::uint64_t{0}, true, sample(kind)};
    CAPTURE(kind_name(big.message));
    {
      const frame f = encode(big);
      const auto f_bytes = bytes_of(f);
      const frame g = encode(small);  // while f is held
      CHECK(bytes_of(g) == reference);
      CHECK(bytes_of(f) == f_bytes);
    }  // g, then f, dropped: the next encode builds in f's memory
    const frame again = encode(small);
    CHECK(bytes_of(again) == reference);
    const auto got = decode(gather(again), again.bytes, wide());
    CHECK(got.target == 2);
    check_header(std::get<link_credit>(got.message).header,
                 std::get<link_credit>(small.message).header);
  }
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
  SECTION("a view one float into a buffer is sent from its own memory, landing aligned") {
    const auto base = floats(9, 13);
    const auto view = std::make_shared<payload<float>>(base, base->data() + 1, 8);
    const frame f = encode({0, 0, 0, false, tied_grad{0, 0, view}});
    CHECK(std::any_of(f.iov.begin(), f.iov.end(),
                      [&](const auto& e) { return e.first == view->data() && e.second == 32; }));
    checker{decode(gather(f), f.bytes, wide()).message}(tied_grad{0, 0, view});
  }
  SECTION("a misaligned view in a frame of several segments is copied once") {
    // 8-byte pieces: 500 piece pointers do not fit the builder's first segment.
    const auto base = floats(1001, 13);
    const auto view = std::make_shared<payload<float>>(base, base->data() + 1, 1000);
    const frame f = detail::encode({0, 0, 0, false, tied_grad{0, 0, view}}, 8);
    std::uint32_t more_segments = 0;
    std::memcpy(&more_segments, f.iov.at(0).first, 4);
    CHECK(more_segments > 0);
    CHECK(std::none_of(f.iov.begin(), f.iov.end(), [&](const auto& e) {
      const auto* p = static_cast<const float*>(e.first);
      return p >= view->data() && p < view->data() + view->size();
    }));
    checker{decode(gather(f), f.bytes, wide()).message}(tied_grad{0, 0, view});
  }
  SECTION("an empty payload is an empty view") {
    const auto got = round_trip({0, 0, 0, false, tied_grad{0, 0, floats(0, 0)}});
    CHECK(std::get<tied_grad>(got.message).data->size() == 0);
  }
}

TEST_CASE("a payload starts at a multiple of 64 bytes into its frame", "[unit]") {
  // Headers of different sizes (shapes of 0 to 9 dimensions), so that the padding before the
  // payload takes every value it can (0 to 56 bytes).
  for (std::size_t dims = 0; dims < 10; ++dims) {
    INFO("shape of " << dims << " dimensions");
    link_message m;
    m.header.shape.assign(dims, 1);
    if (dims > 0) m.header.shape[0] = 40;
    m.data = floats(dims == 0 ? 1 : 40, static_cast<std::uint32_t>(dims));
    const frame f = encode({7, 1, 0, false, m});
    auto buf = gather(f);
    const auto got = std::get<link_message>(decode(buf, f.bytes, wide()).message);
    const auto offset = reinterpret_cast<const std::byte*>(got.data->data()) - buf->data();
    CHECK(offset % 64 == 0);
    check_payload(m.data, got.data);
  }
}

namespace {
std::uint32_t segments_of(const frame& f) {
  std::uint32_t count_minus_one = 0;
  std::memcpy(&count_minus_one, f.iov.at(0).first, 4);
  return count_minus_one + 1;
}
}  // namespace

TEST_CASE("a frame is one segment with its payloads inside, unless the builder needed more",
          "[unit]") {
  SECTION("an activation: one segment, the payload referenced, read in place") {
    link_message m{header(link_kind::activation, {2, 8, 64}), floats(1024, 31), 5};
    const frame f = encode({3, 1, 0, false, m});
    CHECK(segments_of(f) == 1);
    CHECK(std::any_of(f.iov.begin(), f.iov.end(), [&](const auto& e) {
      return e.first == m.data->data() && e.second == 4096;
    }));
    auto buf = gather(f);
    const auto got = decode(buf, f.bytes, wide());
    checker{got.message}(m);
    const auto* data =
        reinterpret_cast<const std::byte*>(std::get<link_message>(got.message).data->data());
    CHECK((data - buf->data()) % 64 == 0);
  }
  SECTION("several payloads of odd sizes in one segment, each 64-byte aligned and exact") {
    stage_snapshot m{
        1,
        0,
        {{"a", std::vector<float>(3, 1.5f)}, {"b", {}}, {"c", std::vector<float>(17, -2.0f)}},
        {},
        {}};
    const frame f = encode({0, 0, 0, false, m});
    CHECK(segments_of(f) == 1);
    auto buf = gather(f);
    const auto got = std::get<stage_snapshot>(decode(buf, f.bytes, wide()).message);
    CHECK(got.parameters == m.parameters);
  }
  SECTION("a long message without payloads keeps the builder's segments") {
    trace_batch m;
    for (int i = 0; i < 200; ++i) {
      engine::trace::event ev;
      ev.name = std::to_string(i);  // not "F" + ...: GCC 12's -Wrestrict misfires on it here
      ev.name.insert(ev.name.begin(), 'F');
      ev.category = "compute";
      ev.ts_us = i;
      ev.step = i;
      m.events.push_back(ev);
    }
    const frame f = encode({0, 0, 0, false, m});
    CHECK(segments_of(f) > 1);
    const auto got = std::get<trace_batch>(decode(gather(f), f.bytes, wide()).message);
    REQUIRE(got.events.size() == m.events.size());
    for (std::size_t i = 0; i < m.events.size(); ++i) {
      CHECK(got.events[i].name == m.events[i].name);
      CHECK(got.events[i].step == m.events[i].step);
    }
  }
  SECTION("a message too big for one builder segment: one segment per piece, still exact") {
    stage_snapshot m{1, 0, {}, {}, {}};
    for (int i = 0; i < 200; ++i)
      m.parameters.push_back({"layer." + std::to_string(i) + ".weight",
                              std::vector<float>(static_cast<std::size_t>(i % 7 + 1), float(i))});
    const frame f = encode({0, 0, 0, false, m});
    CHECK(segments_of(f) > 1);
    const auto got = std::get<stage_snapshot>(decode(gather(f), f.bytes, wide()).message);
    CHECK(got.parameters == m.parameters);
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

// A link message's payload may travel beside it, on a device link between processes: the
// message is then its header alone, and comes out with no data.
TEST_CASE("a header-only link message crosses without data", "[unit]") {
  link_message m{header(link_kind::gradient, {2, 8, 64}), nullptr, 9};
  const frame f = encode({4, 1, 0, false, m});
  const auto got = std::get<link_message>(decode(gather(f), f.bytes, wide()).message);
  CHECK(got.data == nullptr);
  CHECK(got.flow_id == 9);
  CHECK(got.header.kind == link_kind::gradient);
  CHECK(got.header.shape == std::vector<std::int64_t>{2, 8, 64});
  // Its shape still says what the link carries: [B, T, C], each within the limits.
  m.header.shape = {5};
  const frame flat = encode({4, 1, 0, false, m});
  CHECK_THAT(refused_with([&] { decode(gather(flat), flat.bytes, wide()); }),
             Catch::Contains("header-only message needs [B, T, C]"));
  m.header.shape = {1, -2, 3};
  const frame negative = encode({4, 1, 0, false, m});
  CHECK_THAT(refused_with([&] { decode(gather(negative), negative.bytes, wide()); }),
             Catch::Contains("shape dimension -2 is negative or too large"));
}

TEST_CASE("encode refuses messages without their plan", "[unit]") {
  CHECK_THAT(refused_with([] {
               encode({0, 0, 0, false, step_plan{}});
             }),
             Catch::Contains("step_plan.plan: null plan"));
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
  wrong.ranks[0][0].virtual_stage = 1;
  REQUIRE_THAT(refused_with(encode(
                   {5, 0, 0, false,
                    step_plan{4, 1, true, std::make_shared<const engine::pipeline_plan>(wrong)}})),
               Catch::Contains("rank 0 has action"));
}
