// The pipeline links and data-parallel groups of a device job between processes: which, in
// which order (every process computes the same lists; the welcome's NCCL ids open them in order).
#include <catch2/catch.hpp>

#include "topology/process_links.hpp"

using namespace troupe;
using topology::process_link;

namespace {
engine::gpt_config model(int layers) {
  engine::gpt_config c;
  c.layers = layers;
  return c;
}
}  // namespace

TEST_CASE("process links: the pairs of ranks in different processes, in one order",
          "[unit][placement]") {
  SECTION("PP=4 in 2 processes: the middle pair, both ways (not the tied wte's ends)") {
    const auto layout = engine::make_pipeline_layout(model(4), 4, 1);
    const auto links = topology::process_links(layout, topology::job_placement(4, 1, 2), 1, 1);
    const std::vector<process_link> want = {{0, 1, 2}, {0, 2, 1}};
    CHECK(links == want);
    CHECK(links[0].name() == "pp-0-1-2");
  }
  SECTION("PP=2 x 2 virtual stages in 2 processes: each ordered pair once") {
    const auto layout = engine::make_pipeline_layout(model(4), 2, 2);
    const auto links = topology::process_links(layout, topology::job_placement(2, 1, 2), 1, 1);
    const std::vector<process_link> want = {{0, 0, 1}, {0, 1, 0}};
    CHECK(links == want);
  }
  SECTION("PP=2 x DP=2 in 2 processes: a replica per process, nothing between them") {
    const auto layout = engine::make_pipeline_layout(model(2), 2, 1);
    CHECK(topology::process_links(layout, topology::job_placement(2, 2, 2), 2, 1).empty());
  }
  SECTION("PP=2 x DP=2 in 4 processes: each lane's pairs, lane by lane") {
    const auto layout = engine::make_pipeline_layout(model(2), 2, 1);
    const auto links = topology::process_links(layout, topology::job_placement(2, 2, 4), 2, 1);
    REQUIRE(links.size() == 4);
    for (std::size_t i = 0; i < links.size(); ++i) CHECK(links[i].lane == static_cast<int>(i / 2));
  }
  SECTION("the tied wte's links: the embedding's rank and the head's, both ways, by lane") {
    const auto layout = engine::make_pipeline_layout(model(4), 4, 1);
    const auto tied = topology::process_tied_links(layout, topology::job_placement(4, 2, 4), 2, 1);
    const std::vector<process_link> want = {
        {0, 0, 3, true}, {0, 3, 0, true}, {1, 0, 3, true}, {1, 3, 0, true}};
    CHECK(tied == want);
    CHECK(tied[1].name() == "tied-0-3-0");
    // Both ends in one process, or one rank holding both ends: none.
    CHECK(topology::process_tied_links(layout, topology::job_placement(4, 1, 1), 1, 1).empty());
    const auto one = engine::make_pipeline_layout(model(2), 1, 1);
    CHECK(topology::process_tied_links(one, topology::job_placement(1, 2, 2), 2, 1).empty());
  }
  SECTION("TP=2 in 2 processes: the shards of a rank are apart, but no pipeline pair is") {
    const auto layout = engine::make_pipeline_layout(model(2), 1, 1);
    CHECK(topology::process_links(layout, topology::job_placement(1, 1, 2, 2), 1, 2).empty());
  }
}

TEST_CASE(
    "process groups: the data-parallel groups whose replicas are each in a process of "
    "their own",
    "[unit][placement]") {
  using topology::process_group;
  SECTION("PP=2 x DP=2 in 4 processes: a group per pipeline rank") {
    const auto groups = topology::process_groups(topology::job_placement(2, 2, 4), 2, 2, 1);
    const std::vector<process_group> want = {{0, 0}, {1, 0}};
    CHECK(groups == want);
    CHECK(groups[1].name() == "dp-1-0");
  }
  SECTION("PP=2 x DP=2 in 2 processes: a replica per process, so still a group per rank") {
    const std::vector<process_group> want = {{0, 0}, {1, 0}};
    CHECK(topology::process_groups(topology::job_placement(2, 2, 2), 2, 2, 1) == want);
  }
  SECTION("DP=2 x TP=2 in 4 processes: a group per tensor shard") {
    const std::vector<process_group> want = {{0, 0}, {0, 1}};
    CHECK(topology::process_groups(topology::job_placement(1, 2, 4, 2), 1, 2, 2) == want);
  }
  SECTION("DP=4 in 2 processes: two replicas share each process, so no group") {
    CHECK(topology::process_groups(topology::job_placement(1, 4, 2), 1, 4, 1).empty());
  }
  SECTION("PP=2 in 2 processes, or DP=2 in one: nothing to average between processes") {
    CHECK(topology::process_groups(topology::job_placement(2, 1, 2), 2, 1, 1).empty());
    CHECK(topology::process_groups(topology::job_placement(1, 2, 1), 1, 2, 1).empty());
  }
}

TEST_CASE(
    "process tensor groups: the tensor groups whose shards are each in a process of their "
    "own",
    "[unit][placement]") {
  using topology::process_tensor_group;
  SECTION("PP=2 x DP=2 x TP=2 in 8 processes: a group per replica and rank") {
    const auto groups =
        topology::process_tensor_groups(topology::job_placement(2, 2, 8, 2), 2, 2, 2);
    const std::vector<process_tensor_group> want = {{0, 0}, {0, 1}, {1, 0}, {1, 1}};
    CHECK(groups == want);
    CHECK(groups[2].name() == "tp-1-0");
  }
  SECTION("TP=2 in 2 processes: one group") {
    const std::vector<process_tensor_group> want = {{0, 0}};
    CHECK(topology::process_tensor_groups(topology::job_placement(1, 1, 2, 2), 1, 1, 2) == want);
  }
  SECTION("PP=2 x TP=2 in 2 processes: a rank's shards share a process, so no group") {
    CHECK(topology::process_tensor_groups(topology::job_placement(2, 1, 2, 2), 2, 1, 2).empty());
  }
  SECTION("TP=1: none") {
    CHECK(topology::process_tensor_groups(topology::job_placement(2, 1, 2), 2, 1, 1).empty());
  }
}
