// The wire codec, refusals: every malformed or oversized frame is a wire_error naming what is
// wrong (limits, truncation, alignment, shapes, version, schema, plans, random and mutated bytes);
// limits_for on the default recipe admits what the recipe sends, nothing larger.
// Frames are patched by hand in a few tests, following the Cap'n Proto encoding spec
// (capnproto.org/encoding.html) and the Envelope layout `capnp compile -ocapnp` prints.
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
    const stage_snapshot snap{0, 0, {{"a", {}}, {"b", {}}, {"c", {}}, {"d", {}}}, {}, {}};
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

TEST_CASE("a tensor exchange of an unknown collective or a torn double is refused", "[unit]") {
  tensor_exchange m{3, 1, static_cast<tensor_exchange::op>(7), floats(4, 1), ""};
  const frame bad_op = encode({0, 0, 0, false, m});
  CHECK(refused_with([&] { decode(gather(bad_op), bad_op.bytes, wide()); }) ==
        "wire: tensor_exchange.op: unknown collective 7");
  m.kind = tensor_exchange::op::sum_f64;
  m.data = floats(5, 1);
  const frame torn = encode({0, 0, 0, false, m});
  CHECK(refused_with([&] { decode(gather(torn), torn.bytes, wide()); }) ==
        "wire: tensor_exchange.data: a double sum of 5 floats (an odd count)");
}

TEST_CASE(
    "a missing or scattered payload is refused, but for a header-only link message or "
    "tied wte gradient",
    "[unit]") {
  const envelope e{0, 0, 0, false,
                   link_message{header(link_kind::activation, {1, 1, 5}), floats(5, 1)}};
  const frame f = detail::encode(e, 16);  // pieces of 16 and 4 bytes
  auto buf = gather(f);
  const auto message = follow(root_of(*buf).pointer(0));  // LinkMessage: header, data
  SECTION("no payload: a link message is then its header alone (its payload on a device link)") {
    poke<std::uint64_t>(message.pointer(1), 0);
    CHECK(std::get<link_message>(decode(buf, f.bytes, wide()).message).data == nullptr);
  }
  SECTION("no payload: a tied wte gradient is then its header alone (its copy on a device link)") {
    const frame t = detail::encode({0, 0, 0, false, tied_grad{3, 0, floats(5, 1)}}, 16);
    auto tbuf = gather(t);
    poke<std::uint64_t>(follow(root_of(*tbuf).pointer(0)).pointer(0), 0);  // TiedGrad.data
    const auto got = std::get<tied_grad>(decode(tbuf, t.bytes, wide()).message);
    CHECK(got.step == 3);
    CHECK(got.data == nullptr);
  }
  SECTION("no payload where one is required") {
    const frame t = detail::encode(
        {0, 0, 0, false, batch_message{batch_part::inputs, 0, 0, 0, 0, false, 1, 5, tokens(5)}},
        16);
    auto tbuf = gather(t);
    poke<std::uint64_t>(follow(root_of(*tbuf).pointer(0)).pointer(0), 0);  // BatchMessage.tokens
    CHECK(refused_with([&] { decode(tbuf, t.bytes, wide()); }) ==
          "wire: batch_message.tokens: missing payload");
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
  for (const auto& param : engine::chunk_parameter_layout(r.model, layout.rank_chunks(0).at(0)))
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
