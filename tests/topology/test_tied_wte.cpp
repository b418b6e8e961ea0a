// The tied wte's exchange (topology/tied_wte.hpp) without actors: the embedding's rank and the
// head's rank each end with own + other, bitwise the same on both, whether the copies travel
// inside the messages (CPU chunks), through links (device chunks of the host kind), or staged
// through host memory (device chunks without links), and whichever copy arrives first; two copies
// on one rank are summed in place; a copy that is not final does not leave; a copy without data
// at a rank without a link is refused.
#include <catch2/catch.hpp>

#include <algorithm>
#include <memory>
#include <vector>

#include "engine/chunks/device_chunk.hpp"
#include "engine/chunks/rank_chunks.hpp"
#include "topology/grad_buckets.hpp"
#include "topology/tied_wte.hpp"

using namespace troupe;

namespace {

const engine::gpt_config kModel{97, 128, 32, 2, 4, 64};

// One rank's chunks with its wte gradient filled with a pattern.
struct rank {
  std::unique_ptr<engine::rank_chunks> chunks;
  topology::grad_buckets buckets;
  std::vector<float> wte(int c) const {
    for (const auto& p : chunks->layout(c))
      if (p.name == "transformer.wte.weight") {
        const float* g = chunks->gradients(c) + p.offset;
        return {g, g + p.numel};
      }
    return {};
  }
};

rank make_rank(const std::vector<engine::chunk_range>& ranges, bool device, float salt) {
  rank r;
  auto init = [](engine::gpt_chunk& st) { st.init_gpt2(1); };
  static const auto factory = engine::host_chunks(false);
  r.chunks = device ? engine::make_device_rank_chunks(factory, kModel, ranges, {}, init, 2, 8, 1, 0,
                                                      0, nullptr)
                    : engine::make_cpu_rank_chunks(kModel, ranges, init, true, false);
  std::vector<std::vector<engine::grad_block>> blocks;
  std::vector<float*> grads;
  for (int c = 0; c < r.chunks->chunk_count(); ++c) {
    blocks.push_back(r.chunks->grad_blocks(c));
    grads.push_back(r.chunks->gradients(c));
    float* g = r.chunks->gradients(c);
    for (std::int64_t i = 0; i < r.chunks->parameter_count(c); ++i)
      g[i] = salt + static_cast<float>(i % 97) * 0.001f;
  }
  r.buckets.build(blocks, grads, 1);
  return r;
}

int bucket_of_wte(const rank& r, int c) {
  for (const auto& p : r.chunks->layout(c))
    if (p.name == "transformer.wte.weight")
      return r.buckets.bucket_containing(r.chunks->gradients(c) + p.offset);
  return -1;
}

}  // namespace

TEST_CASE("the tied wte's two ranks end with own + other, bitwise alike", "[tied-wte]") {
  const auto ranges = engine::partition_layers(kModel, 2);  // rank 0: embedding; rank 1: head
  for (const int kind : {0, 1, 2}) {  // CPU chunks; device chunks with links; staged
    for (const bool head_first : {false, true}) {
      INFO("kind " << kind << (head_first ? ", the head's copy first" : ""));
      const bool device = kind > 0;
      rank a = make_rank({ranges[0]}, device, 0.5f);
      rank b = make_rank({ranges[1]}, device, -0.25f);
      std::shared_ptr<engine::chunk_link> ab, ba;
      if (kind == 1) {
        const auto factory = engine::host_chunks(false);
        ab = factory.make_link(0, 1, 0);
        ba = factory.make_link(1, 0, 0);
      }
      topology::tied_wte ta(*a.chunks, a.buckets, 0, -1, ab, ba, "rank 0");
      topology::tied_wte tb(*b.chunks, b.buckets, -1, 0, ba, ab, "rank 1");
      CHECK(ta.copies() == 1);
      CHECK(tb.copies() == 1);
      const auto wa = a.wte(0), wb = b.wte(0);
      std::vector<float> sum(wa.size());
      for (std::size_t i = 0; i < sum.size(); ++i) sum[i] = wa[i] + wb[i];
      ta.start();
      tb.start();
      CHECK_FALSE(ta.bucket_final(bucket_of_wte(a, 0) + 1).has_value());  // another bucket
      auto* first = head_first ? &tb : &ta;
      auto* second = head_first ? &ta : &tb;
      const int first_bucket = bucket_of_wte(head_first ? b : a, 0);
      const int second_bucket = bucket_of_wte(head_first ? a : b, 0);
      const auto from_first = first->bucket_final(first_bucket);
      REQUIRE(from_first.has_value());
      CHECK((*from_first != nullptr) == (kind != 1));  // the payload rides in the message
      second->received(*from_first);  // arrives before the second's own copy is final
      CHECK_FALSE(second->done());
      const auto from_second = second->bucket_final(second_bucket);
      REQUIRE(from_second.has_value());
      CHECK(second->done());
      first->received(*from_second);
      CHECK(first->done());
      CHECK(a.wte(0) == sum);
      CHECK(b.wte(0) == sum);
    }
  }
}

TEST_CASE("two tied copies on one rank are summed in place", "[tied-wte]") {
  const auto ranges = engine::partition_layers(kModel, 2);  // both on this rank (two chunks)
  for (const bool device : {false, true}) {
    rank r = make_rank(ranges, device, 0.125f);
    topology::tied_wte t(*r.chunks, r.buckets, 0, 1, nullptr, nullptr, "rank 0");
    CHECK(t.copies() == 2);
    const auto w0 = r.wte(0), w1 = r.wte(1);
    t.start();
    CHECK_FALSE(t.bucket_final(bucket_of_wte(r, 1)).has_value());
    CHECK_FALSE(t.done());  // one of the two copies is final
    CHECK_FALSE(t.bucket_final(bucket_of_wte(r, 0)).has_value());
    CHECK(t.done());
    std::vector<float> sum(w0.size());
    for (std::size_t i = 0; i < sum.size(); ++i) sum[i] = w0[i] + w1[i];
    CHECK(r.wte(0) == sum);
    CHECK(r.wte(1) == sum);
  }
}

// A header-only tied_grad (its copy on a device link between processes) at a rank that has no
// such link: refused with one line naming the rank, never read as zeros.
TEST_CASE("a tied wte gradient without data, at a rank without a link, is refused", "[tied-wte]") {
  const auto ranges = engine::partition_layers(kModel, 2);
  for (const bool device : {false, true}) {
    INFO((device ? "device chunks, no links" : "CPU chunks"));
    rank b = make_rank({ranges[1]}, device, -0.25f);
    topology::tied_wte tb(*b.chunks, b.buckets, -1, 0, nullptr, nullptr, "stage 1 · dp 0");
    tb.start();
    CHECK_THROWS_WITH(tb.received(nullptr),
                      device ? "stage 1 · dp 0: a tied wte gradient without data, and no device "
                               "link from the partner to receive it by"
                             : "stage 1 · dp 0: a tied wte gradient without data (a CPU stage "
                               "takes its partner's copy inside the message)");
    CHECK_FALSE(tb.done());
  }
}
