// The one chunk contract (engine/chunks/rank_chunks.hpp) without actors: CPU chunks and device
// chunks (host_chunks, the device contract's host kind) driven through the same calls, two chunks
// of a rank with two micro-batches in flight, payloads moved by the caller as a stage's links
// would, give bitwise the same losses, gradients and updated weights, the two micro-batches of
// different sequence lengths; what device chunks do not do yet is refused naming it; slots grow
// when the micro-batches in flight outnumber them; a split backward (B, then W) is the whole
// backward.
#include <catch2/catch.hpp>

#include <cstring>
#include <memory>
#include <vector>

#include "engine/chunks/device_chunk.hpp"
#include "engine/chunks/rank_chunks.hpp"
#include "engine/model/random.hpp"
#include "tests/engine/engine_test_util.hpp"

using namespace troupe::engine;
using troupe::engine::test::error_message;

namespace {

const gpt_config kModel{97, 128, 32, 4, 4, 64};
constexpr int kB = 2, kT = 16;

std::vector<std::int32_t> tokens(std::uint64_t salt, int T = kT) {
  std::vector<std::int32_t> t(std::size_t(kB) * static_cast<std::size_t>(T));
  for (std::size_t i = 0; i < t.size(); ++i)
    t[i] = static_cast<std::int32_t>(splitmix64(salt * 1000 + i) % kModel.vocab_size);
  return t;
}

struct run_result {
  std::vector<double> losses;
  std::vector<std::vector<float>> grads, params;
};

// Chunk 0 (embedding, layers 0-1) and chunk 1 (layers 2-3, head) of one rank; micro-batches 0
// (T = 16) and 1 (T = 11) forward, then backward in reverse order (both in flight), then the
// update.
run_result drive(rank_chunks& rc, bool split = false) {
  REQUIRE(rc.chunk_count() == 2);
  const auto width = static_cast<std::size_t>(kModel.width);
  const std::size_t n = std::size_t(kB) * kT * width;
  run_result r;
  std::vector<std::vector<std::int32_t>> in, target;
  std::vector<std::vector<float>> dinput(2, std::vector<float>(n));
  for (int mb = 0; mb < 2; ++mb) {
    const int T = mb == 0 ? kT : kT - 5;
    in.push_back(tokens(static_cast<std::uint64_t>(mb) + 1, T));
    target.push_back(tokens(static_cast<std::uint64_t>(mb) + 7, T));
    const micro_batch_id id{0, mb};
    rank_chunks::forward_args a0;
    a0.B = kB;
    a0.T = T;
    a0.tokens = in.back().data();
    rc.forward(0, id, std::move(a0)).run();
    rank_chunks::forward_args a1;
    a1.B = kB;
    a1.T = T;
    a1.targets = target.back().data();
    a1.loss_scale = 0.5f;
    if (rc.host_payloads()) {
      a1.input = rc.output(0, id);  // read in place, as from a message's payload
    } else {                        // through a "link": the sender's buffer into the receiver's
      std::memcpy(rc.receive_buffer(1, id, payload_kind::activation, kB, T),
                  rc.send_buffer(0, id, payload_kind::activation), rc.payload_bytes(0, id));
    }
    rc.forward(1, id, std::move(a1)).run();
    r.losses.push_back(rc.loss(1, id));
  }
  for (int mb = 1; mb >= 0; --mb) {
    const micro_batch_id id{0, mb};
    auto& din = dinput[static_cast<std::size_t>(mb)];
    if (split) {  // B now, W after both micro-batches' B
      rc.backward_input(1, id, nullptr, din.data()).run();
    } else {
      rc.backward(1, id, nullptr, din.data(), {}).run();
    }
    CHECK(rc.shape(1, id) == std::pair<int, int>{kB, mb == 0 ? kT : kT - 5});
    if (!rc.host_payloads())
      std::memcpy(rc.receive_buffer(0, id, payload_kind::gradient, kB, mb == 0 ? kT : kT - 5),
                  rc.send_buffer(1, id, payload_kind::gradient), rc.payload_bytes(1, id));
    if (split) {
      rc.backward_input(0, id, din.data(), nullptr).run();
      continue;
    }
    rc.backward(0, id, din.data(), nullptr, {}).run();
    rc.release(1, id);
    rc.release(0, id);
  }
  for (int mb = 1; split && mb >= 0; --mb) {
    const micro_batch_id id{0, mb};
    for (int c : {1, 0}) {
      rc.backward_weight(c, id, {}).run();
      rc.release(c, id);
    }
  }
  // The tied wte: chunk 0 (embedding) and chunk 1 (head) each hold a copy; sum them.
  std::int64_t wte[2] = {-1, -1}, numel = 0;
  for (int c = 0; c < 2; ++c)
    for (const auto& p : rc.layout(c))
      if (p.name == "transformer.wte.weight") {
        wte[c] = p.offset;
        numel = p.numel;
      }
  REQUIRE(wte[0] >= 0);
  REQUIRE(wte[1] >= 0);
  rc.add_gradients(0, wte[0], rc.gradients(1) + wte[1], numel);
  rc.copy_gradients(1, wte[1], rc.gradients(0) + wte[0], numel);
  double sq = 0;
  for (int c = 0; c < 2; ++c) {
    sq += rc.grad_square_sum(c, c == 0);
    std::vector<float> g(static_cast<std::size_t>(rc.parameter_count(c)));
    std::memcpy(g.data(), rc.gradients(c), g.size() * sizeof(float));  // host memory here
    r.grads.push_back(std::move(g));
  }
  optimizer_config oc;
  for (int c = 0; c < 2; ++c) rc.update(c, oc, 0, 10, std::sqrt(sq), 2.0);
  for (int c = 0; c < 2; ++c) r.params.push_back(rc.parameters(c));
  return r;
}

// Where two runs first differ ("" when they do not): keeps a failure's message short.
std::string first_difference(const run_result& a, const run_result& b) {
  if (a.losses != b.losses)
    return "losses " + std::to_string(a.losses.at(0)) + ", " + std::to_string(a.losses.at(1)) +
           " vs " + std::to_string(b.losses.at(0)) + ", " + std::to_string(b.losses.at(1));
  for (const auto what : {&run_result::grads, &run_result::params}) {
    const auto& x = a.*what;
    const auto& y = b.*what;
    for (std::size_t c = 0; c < x.size(); ++c)
      for (std::size_t i = 0; i < x[c].size(); ++i)
        if (x[c][i] != y[c][i])
          return std::string(what == &run_result::grads ? "gradient" : "parameter") + " " +
                 std::to_string(i) + " of chunk " + std::to_string(c) + ": " +
                 std::to_string(x[c][i]) + " vs " + std::to_string(y[c][i]);
  }
  return "";
}

chunk_init gpt2_init(std::uint64_t seed) {
  return [seed](gpt_chunk& st) { st.init_gpt2(seed); };
}

}  // namespace

TEST_CASE("CPU and device chunks behind the one contract compute the same, bitwise",
          "[rank-chunks]") {
  const auto ranges = partition_layers(kModel, 2);
  auto cpu = make_cpu_rank_chunks(kModel, ranges, gpt2_init(5), true, false);
  const auto factory = host_chunks(false);
  auto device =
      make_device_rank_chunks(factory, kModel, ranges, {}, gpt2_init(5), kB, kT, 1, 0, 0, nullptr);
  CHECK(cpu->kind() == "cpu");
  CHECK(device->kind() == "host");
  CHECK(cpu->cpu_chunk(0) != nullptr);
  CHECK(device->cpu_chunk(0) == nullptr);
  for (int c = 0; c < 2; ++c) {
    CHECK(cpu->parameters(c) == device->parameters(c));
    CHECK(cpu->grad_blocks(c).size() == device->grad_blocks(c).size());
  }
  const auto a = drive(*cpu);
  const auto b = drive(*device);  // one slot a chunk to start with: the second micro-batch adds one
  CHECK(first_difference(a, b) == "");
  CHECK(a.losses[0] != a.losses[1]);
}

TEST_CASE("a split backward (B, then W) on CPU and device chunks equals the whole backward",
          "[rank-chunks]") {
  const auto ranges = partition_layers(kModel, 2);
  auto cpu = make_cpu_rank_chunks(kModel, ranges, gpt2_init(9), true, false);
  auto cpu_split = make_cpu_rank_chunks(kModel, ranges, gpt2_init(9), true, false);
  const auto factory = host_chunks(false);
  auto device_split =
      make_device_rank_chunks(factory, kModel, ranges, {}, gpt2_init(9), kB, kT, 2, 0, 0, nullptr);
  const auto whole = drive(*cpu);
  const auto a = drive(*cpu_split, true);
  const auto b = drive(*device_split, true);
  CHECK(first_difference(whole, a) == "");
  CHECK(first_difference(a, b) == "");
}

TEST_CASE("device chunks refuse what they do not do, naming it", "[rank-chunks]") {
  const auto ranges = partition_layers(kModel, 2);
  const auto factory = host_chunks(false);
  auto device =
      make_device_rank_chunks(factory, kModel, ranges, {}, gpt2_init(5), kB, kT, 1, 0, 0, nullptr);
  const auto t = tokens(1);
  rank_chunks::forward_args too_long;
  too_long.B = kB;
  too_long.T = kT + 1;
  too_long.tokens = t.data();
  CHECK_THAT(error_message([&] {
               device->forward(0, {0, 0}, too_long).run();
             }),
             Catch::Contains("2 x 17") && Catch::Contains("2 x 1 to 16"));
  rank_chunks::forward_args args;
  args.B = kB;
  args.T = kT;
  args.tokens = t.data();
  device->forward(0, {0, 0}, args).run();
  CHECK_THAT(error_message([&] { device->output(0, {0, 0}); }), Catch::Contains("on the device"));
  CHECK_THAT(error_message<std::logic_error>([&] {
               device->send_buffer(1, {0, 3}, payload_kind::activation);
             }),
             Catch::Contains("no slot") && Catch::Contains("micro-batch 3"));
}

// What the rendezvous compares to tell whether NCCL can join two processes' devices.
TEST_CASE("a device's identity: its bus id, and NCCL's host id where one is set", "[rank-chunks]") {
  CHECK(device_identity("0000:00:06.0", std::nullopt) == "0000:00:06.0");
  CHECK(device_identity("0000:00:06.0", "") == "0000:00:06.0 on NCCL host \"\"");  // set, empty
  CHECK(device_identity("", "host-a").empty());                                    // no device
  CHECK(device_identity("0000:00:06.0", "host-a") == "0000:00:06.0 on NCCL host host-a");
  CHECK(device_identity("0000:00:06.0", "host-a") != device_identity("0000:00:06.0", "host-b"));
  // A long host id by its hash: within the rendezvous's 64 bytes, still telling ids apart.
  const std::string a(200, 'a'), b = std::string(199, 'a') + "b";
  const auto long_a = device_identity("0000:00:06.0", a);
  CHECK(long_a.size() <= 64);
  CHECK(long_a.rfind("0000:00:06.0 on NCCL host xxh64:", 0) == 0);
  CHECK(long_a == device_identity("0000:00:06.0", a));
  CHECK(long_a != device_identity("0000:00:06.0", b));
}
