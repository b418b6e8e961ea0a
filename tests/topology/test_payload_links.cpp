// How payloads cross between two ranks' chunks (topology/payload_links.hpp), without actors:
// device chunks (of the host kind) through their link and staged through host memory both carry
// the embedding rank's activation to the head rank's slot, at each micro-batch's own length, so
// the head's loss is bitwise the CPU chunks' (which read the activation in place); CPU chunks
// hand the payload through untouched; data where a link is, or none where none is, is refused.
#include <catch2/catch.hpp>

#include <memory>
#include <vector>

#include "engine/chunks/device_chunk.hpp"
#include "engine/chunks/rank_chunks.hpp"
#include "tests/engine/engine_test_util.hpp"
#include "topology/payload_links.hpp"

using namespace troupe;
using troupe::engine::test::error_message;

namespace {

const engine::gpt_config kModel{97, 128, 32, 2, 4, 64};
constexpr int kB = 2, kT = 8;

const engine::chunk_init init = [](engine::gpt_chunk& st) { st.init_gpt2(1); };

std::unique_ptr<engine::rank_chunks> device_chunks(const engine::chunk_range& range) {
  static const auto factory = engine::host_chunks(false);
  return engine::make_device_rank_chunks(factory, kModel, {range}, {}, init, kB, kT, 1, 0, 0,
                                         nullptr);
}

engine::rank_chunks::forward_args args(const std::vector<std::int32_t>& tokens,
                                       const std::vector<std::int32_t>& targets, int T) {
  engine::rank_chunks::forward_args a;
  a.B = kB;
  a.T = T;
  a.tokens = tokens.empty() ? nullptr : tokens.data();
  a.targets = targets.empty() ? nullptr : targets.data();
  return a;
}

}  // namespace

TEST_CASE("activations cross through links or staged, each at its micro-batch's length",
          "[links]") {
  const auto ranges = engine::partition_layers(kModel, 2);  // rank 0: embedding; 1: head
  auto cpu_a = engine::make_cpu_rank_chunks(kModel, {ranges[0]}, init, true, false);
  auto cpu_b = engine::make_cpu_rank_chunks(kModel, {ranges[1]}, init, true, false);
  topology::payload_links cpu_links(*cpu_a, {}, {}, "cpu rank 0");
  for (const bool linked : {true, false}) {
    INFO((linked ? "through a link" : "staged through the host"));
    auto a = device_chunks(ranges[0]);
    auto b = device_chunks(ranges[1]);
    topology::payload_links::link_map a_send, b_receive;
    if (linked) a_send[1] = b_receive[0] = engine::host_chunks(false).make_link(0, 1, 0);
    topology::payload_links la(*a, a_send, {}, "rank 0"), lb(*b, {}, b_receive, "rank 1");
    for (const int T : {kT, kT - 3}) {
      INFO("T = " << T);
      const engine::micro_batch_id id{0, T};
      std::vector<std::int32_t> tokens(std::size_t(kB) * T), targets(tokens.size());
      for (std::size_t i = 0; i < tokens.size(); ++i) {
        tokens[i] = static_cast<std::int32_t>((i * 7 + 3) % 97);
        targets[i] = static_cast<std::int32_t>((i * 5 + 1) % 97);
      }
      // The CPU reference: the head reads the embedding rank's output in place.
      cpu_a->forward(0, id, args(tokens, {}, T)).run();
      const auto payload = std::make_shared<messages::payload<float>>(
          cpu_a->output(0, id), cpu_a->output(0, id) + std::size_t(kB) * T * kModel.width);
      CHECK(cpu_links.send(0, id, engine::payload_kind::activation, 1, payload) == payload);
      auto cpu_args = args({}, targets, T);
      cpu_args.input = payload->data();
      cpu_b->forward(0, id, cpu_args).run();
      // The device chunks: the payload crosses, then the head's forward.
      a->forward(0, id, args(tokens, {}, T)).run();
      const auto data = la.send(0, id, engine::payload_kind::activation, 1, nullptr);
      CHECK((data == nullptr) == linked);
      if (data) CHECK(data->size() == std::size_t(kB) * T * kModel.width);
      lb.receive(0, id, engine::payload_kind::activation, kB, T, 0, data);
      b->forward(0, id, args({}, targets, T)).run();
      CHECK(b->loss(0, id) == cpu_b->loss(0, id));
      for (auto* r : {cpu_a.get(), cpu_b.get(), a.get(), b.get()}) r->release(0, id);
    }
    // Data where a link is, or none where none is: the sender and receiver disagree.
    const engine::micro_batch_id id{1, 0};
    const auto stray = std::make_shared<messages::payload<float>>(std::size_t(4));
    CHECK_THAT(
        error_message<std::logic_error>([&] {
          lb.receive(0, id, engine::payload_kind::activation, kB, kT, 0, linked ? stray : nullptr);
        }),
        Catch::Contains("rank 0") && Catch::Contains(linked ? "with host data" : "without data"));
  }
}
