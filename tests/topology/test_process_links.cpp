// The pipeline links of a device job between processes: which pairs, in which order (every
// process computes the same list; NCCL id i of the welcome opens link i).
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
  SECTION("TP=2 in 2 processes: the shards of a rank are apart, but no pipeline pair is") {
    const auto layout = engine::make_pipeline_layout(model(2), 1, 1);
    CHECK(topology::process_links(layout, topology::job_placement(1, 1, 2, 2), 1, 2).empty());
  }
}
