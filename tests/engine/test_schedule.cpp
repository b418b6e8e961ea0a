// Pipeline schedules and the simulator: the token notation and plan text round trips; every
// built-in plan on many shapes (also with random costs and latency) runs without errors or
// deadlock and keeps the simulator's own timing invariants; the known bubble fractions
// (GPipe and 1F1B (p-1)/(m+p-1), interleaved cut by about 1/v, ZB-H1 about a third of 1F1B);
// held activations per rank; bad plans and deadlocks named; user schedules in the registry.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cstdio>
#include <map>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "engine/parallel/schedule.hpp"
#include "engine/parallel/schedule_sim.hpp"

using namespace troupe::engine;

namespace {

const std::vector<int> kRanks = {1, 2, 3, 4, 8};
const std::vector<int> kMicroBatches = {1, 2, 3, 4, 8, 16};

pipeline_action F(int k, int mb) { return {action_kind::forward, k, mb}; }
pipeline_action B(int k, int mb) { return {action_kind::backward, k, mb}; }
pipeline_action W(int k, int mb) { return {action_kind::weight, k, mb}; }

// A plan written by hand as text, one line per rank.
pipeline_plan plan_of(const std::string& text, int p, int m, int v = 1) {
  return parse_plan(text, schedule_shape{p, m, v}, "hand-written");
}

// Every shape a built-in serves among those the tests sweep.
std::vector<std::pair<std::string, schedule_shape>> all_built_in_shapes() {
  std::vector<std::pair<std::string, schedule_shape>> out;
  for (int p : kRanks) {
    for (int m : kMicroBatches) {
      for (const char* name : {"gpipe", "1f1b", "zb_h1"}) out.push_back({name, {p, m, 1}});
      if (m % p != 0) continue;
      for (int v : {2, 3}) out.push_back({"interleaved_1f1b", {p, m, v}});
    }
  }
  return out;
}

std::string describe(const std::string& name, const schedule_shape& s) {
  return name + " p=" + std::to_string(s.ranks) + " m=" + std::to_string(s.micro_batches) +
         " v=" + std::to_string(s.virtual_stages);
}

// The simulator's timing obeys its own rules: a rank runs one action at a time, in plan order,
// and each action starts after its inputs (plus the latency when they come from another rank).
void check_timing_invariants(const pipeline_plan& plan, const action_costs& costs,
                             const simulation& sim) {
  std::map<std::tuple<int, int, int>, double> end;
  for (const auto& rank : sim.timeline) {
    for (const timed_action& t : rank) {
      end[{static_cast<int>(t.action.kind), t.action.virtual_stage, t.action.micro_batch}] = t.end;
    }
  }
  const auto ready = [&](const pipeline_action& dep, int rank) {
    const double lat = plan.shape.rank_of(dep.virtual_stage) != rank ? costs.comm_latency : 0.0;
    return end.at({static_cast<int>(dep.kind), dep.virtual_stage, dep.micro_batch}) + lat;
  };
  const int last = plan.shape.virtual_stage_count() - 1;
  for (int r = 0; r < plan.shape.ranks; ++r) {
    const auto& line = sim.timeline[static_cast<size_t>(r)];
    REQUIRE(line.size() == plan.ranks[static_cast<size_t>(r)].size());
    for (size_t i = 0; i < line.size(); ++i) {
      const timed_action& t = line[i];
      REQUIRE(t.action == plan.ranks[static_cast<size_t>(r)][i]);
      if (i > 0) REQUIRE(t.start >= line[i - 1].end - 1e-12);
      const int k = t.action.virtual_stage, j = t.action.micro_batch;
      if (t.action.kind == action_kind::forward && k > 0) REQUIRE(t.start >= ready(F(k - 1, j), r));
      if (t.action.kind == action_kind::backward) {
        REQUIRE(t.start >= ready(F(k, j), r));
        if (k < last) REQUIRE(t.start >= ready(B(k + 1, j), r));
      }
      if (t.action.kind == action_kind::weight) REQUIRE(t.start >= ready(B(k, j), r));
      REQUIRE(t.end <= sim.makespan + 1e-12);
    }
  }
}

// Bubble time of one rank's worth: makespan minus the work of one rank (all ranks equal).
double idle_per_rank(const simulation& sim) { return sim.makespan - sim.busy.front(); }

}  // namespace

TEST_CASE("action tokens round-trip and bad tokens are named", "[schedule]") {
  for (const pipeline_action& a : {F(0, 1), B(2, 3), W(1, 0), F(123, 4567)}) {
    CHECK(parse_token(to_token(a)) == a);
  }
  CHECK(to_token(F(0, 1)) == "0F1");
  CHECK(to_token(B(2, 3)) == "2B3");
  CHECK(to_token(W(1, 0)) == "1W0");
  CHECK(parse_token("12W34") == W(12, 34));
  for (const char* bad :
       {"", "F1", "0F", "0X1", "-1F0", "0F-1", "0F1x", "a0F1", "0 F1", "0FB1", "9999999999F0"}) {
    INFO("token '" << bad << "'");
    REQUIRE_THROWS_AS(parse_token(bad), std::invalid_argument);
    REQUIRE_THROWS_WITH(parse_token(bad),
                        Catch::Contains("'" + std::string(bad) + "'") &&
                            Catch::Contains("<virtual stage><F|B|W><micro-batch>"));
  }
}

TEST_CASE("format_plan and parse_plan round-trip", "[schedule]") {
  for (const auto& [name, shape] : all_built_in_shapes()) {
    INFO(describe(name, shape));
    const pipeline_plan plan = make_plan(name, shape);
    const pipeline_plan back = parse_plan(format_plan(plan), shape, name);
    CHECK(back.ranks == plan.ranks);
    CHECK(back.split_backward == plan.split_backward);
    CHECK(back.name == name);
  }
  const pipeline_plan p = plan_1f1b({2, 2, 1});
  CHECK(format_plan(p) == "rank 0: 0F0 0F1 0B0 0B1\nrank 1: 1F0 1B0 1F1 1B1\n");
  // Comments, blank lines, no prefix, commas (torchtitan CSV) and an empty "rank N:" line.
  const pipeline_plan q =
      plan_of("# a comment\n\nrank 0: 0F0, 0B0 0W0  # trailing\n1F0 1B0 1W0\nrank 2:\n", 3, 1);
  REQUIRE(q.ranks.size() == 3);
  CHECK(q.split_backward);
  CHECK(q.ranks[0] == std::vector{F(0, 0), B(0, 0), W(0, 0)});
  CHECK(q.ranks[1] == std::vector{F(1, 0), B(1, 0), W(1, 0)});
  CHECK(q.ranks[2].empty());
  REQUIRE_THROWS_WITH(plan_of("0F0 0Q0\n", 1, 1), Catch::Contains("'0Q0'"));
}

TEST_CASE("every built-in plan simulates cleanly, with equal and random costs", "[schedule]") {
  std::mt19937 rng(1234);
  std::uniform_real_distribution<double> cost(0.1, 3.0), latency(0.01, 1.0);
  for (const auto& [name, shape] : all_built_in_shapes()) {
    INFO(describe(name, shape));
    const pipeline_plan plan = make_plan(name, shape);
    CHECK(plan.name == name);
    CHECK(plan.ranks.size() == static_cast<size_t>(shape.ranks));
    for (int trial = 0; trial < 4; ++trial) {
      action_costs costs;  // trial 0: all 1, no latency
      if (trial > 0) costs = {cost(rng), cost(rng), cost(rng), latency(rng)};
      const simulation sim = simulate(plan, costs);
      INFO("costs " << costs.forward << " " << costs.backward << " " << costs.weight << " "
                    << costs.comm_latency << "; " << (sim.errors.empty() ? "" : sim.errors[0])
                    << sim.deadlock_report);
      REQUIRE(sim.ok());
      check_timing_invariants(plan, costs, sim);
      const double work = shape.micro_batches * shape.virtual_stages *
                          (costs.forward + costs.backward + costs.weight);
      for (double b : sim.busy) CHECK(b == Approx(work).epsilon(1e-12));
      CHECK(sim.bubble_fraction >= -1e-12);
      CHECK(sim.bubble_fraction < 1);
      CHECK(sim.peak_link_messages.size() == static_cast<size_t>(shape.ranks));
    }
  }
}

TEST_CASE("GPipe and 1F1B bubble is (p-1)/(m+p-1) with equal costs", "[schedule]") {
  for (int p : kRanks) {
    for (int m : kMicroBatches) {
      INFO("p=" << p << " m=" << m);
      const double expected = static_cast<double>(p - 1) / (m + p - 1);
      for (const char* name : {"gpipe", "1f1b"}) {
        const pipeline_plan plan = make_plan(name, {p, m, 1});
        // F=B=1, W=0, and F=B=W=1 (a full backward of 2): the ratio is the same when B = F...
        CHECK(simulate(plan, {1, 1, 0, 0}).bubble_fraction == Approx(expected).margin(1e-12));
        // ... and with a full backward of 2 the bubble is (p-1)(F+B+W) per rank.
        const simulation sim = simulate(plan, {1, 1, 1, 0});
        CHECK(idle_per_rank(sim) == Approx(3.0 * (p - 1)).margin(1e-12));
        CHECK(sim.bubble_fraction == Approx(expected).margin(1e-12));
      }
    }
  }
}

// Megatron's claim: with v chunks per rank the bubble time shrinks to (p-1)(F+B)/v. With the
// per-chunk costs 1/v of a whole stage the fraction is ((p-1)/v) / (m + (p-1)/v). The simulated
// schedule meets it exactly here: the tolerance (1e-12) is only floating-point rounding.
TEST_CASE("interleaved 1F1B cuts the bubble by about 1/v", "[schedule]") {
  for (int p : kRanks) {
    for (int m : kMicroBatches) {
      if (m % p != 0) continue;
      for (int v : {2, 3}) {
        INFO("p=" << p << " m=" << m << " v=" << v);
        const pipeline_plan plan = make_plan("interleaved_1f1b", {p, m, v});
        const double chunk = 1.0 / v;
        const simulation sim = simulate(plan, {chunk, chunk, 0, 0});
        const double bubble = static_cast<double>(p - 1) / v;
        CHECK(sim.bubble_fraction == Approx(bubble / (m + bubble)).margin(1e-12));
        CHECK(idle_per_rank(sim) == Approx(2.0 * bubble).margin(1e-12));  // (p-1)(F+B)/v
        const double one_f_one_b = simulate(plan_1f1b({p, m, 1}), {1, 1, 0, 0}).bubble_fraction;
        CHECK(sim.bubble_fraction <= one_f_one_b + 1e-12);
      }
    }
  }
}

// ZB-H1 (F=B=W=1): bubble (p-1)(F+B-W) per rank against 1F1B's (p-1)(F+B+W): a third.
TEST_CASE("ZB-H1 bubble is about a third of 1F1B's", "[schedule]") {
  for (int p : {2, 3, 4, 8}) {
    for (int m : {8, 16}) {
      if (m < p) continue;
      INFO("p=" << p << " m=" << m);
      const action_costs costs{1, 1, 1, 0};
      const simulation zb = simulate(make_plan("zb_h1", {p, m, 1}), costs);
      const simulation base = simulate(make_plan("1f1b", {p, m, 1}), costs);
      CHECK(idle_per_rank(zb) == Approx((p - 1) * (1.0 + 1.0 - 1.0)).margin(1e-12));
      CHECK(idle_per_rank(base) == Approx((p - 1) * (1.0 + 1.0 + 1.0)).margin(1e-12));
      const double time_ratio = idle_per_rank(zb) / idle_per_rank(base);
      CHECK(time_ratio >= 0.25);
      CHECK(time_ratio <= 0.4);
      // The fractions have different denominators (makespans), so their ratio is a bit above
      // a third: 3/27 against 9/33 = 0.407 for p=4, m=8; 3/51 against 9/57 = 0.373 for m=16.
      const double expected_fraction = (p - 1.0) / (3.0 * m + p - 1.0);
      CHECK(zb.bubble_fraction == Approx(expected_fraction).margin(1e-12));
      CHECK(zb.bubble_fraction < base.bubble_fraction);
    }
  }
}

// 1F1B holds min(p-r, m) micro-batches on rank r; GPipe holds all m. ZB-H1 keeps W passes
// back by r on rank r, so every rank holds up to p (the paper: "all pipeline stages have the
// same number of in-flight microbatches"); the most any rank holds equals 1F1B's (rank 0).
TEST_CASE("activations held per rank", "[schedule]") {
  for (int p : kRanks) {
    for (int m : kMicroBatches) {
      INFO("p=" << p << " m=" << m);
      const simulation one = simulate(plan_1f1b({p, m, 1}));
      const simulation gpipe = simulate(plan_gpipe({p, m, 1}));
      const simulation zb = simulate(plan_zb_h1({p, m, 1}));
      for (int r = 0; r < p; ++r) {
        const size_t i = static_cast<size_t>(r);
        CHECK(one.peak_in_flight[i] == std::min(p - r, m));
        CHECK(gpipe.peak_in_flight[i] == m);
        CHECK(zb.peak_in_flight[i] == std::min(p, m));
      }
      const auto max_of = [](const std::vector<int>& v) {
        return *std::max_element(v.begin(), v.end());
      };
      CHECK(max_of(zb.peak_in_flight) == max_of(one.peak_in_flight));
    }
  }
  // Megatron's interleaved warmup: rank r holds (p-r-1)*2 + (v-1)*p + 1, capped at m*v.
  const simulation inter = simulate(plan_interleaved_1f1b({4, 8, 2}));
  CHECK(inter.peak_in_flight == std::vector<int>{11, 9, 7, 5});
}

TEST_CASE("messages waiting at a rank", "[schedule]") {
  // GPipe, equal costs: every activation and gradient is consumed the moment it arrives.
  CHECK(simulate(plan_gpipe({4, 8, 1}), {1, 1, 0, 0}).peak_link_messages ==
        std::vector<int>{0, 0, 0, 0});
  // Rank 0 sends every forward at once while rank 1 alternates: at t=3 rank 1 has 0F1's and
  // 0F2's activations waiting (sent at 2 and 3, consumed at 3.5 and 5.5; latency 0.5).
  const pipeline_plan slow = plan_of("0F0 0F1 0F2 0B0 0B1 0B2\n1F0 1B0 1F1 1B1 1F2 1B2\n", 2, 3);
  const simulation sim = simulate(slow, {1, 1, 0, 0.5});
  REQUIRE(sim.ok());
  CHECK(sim.peak_link_messages == std::vector<int>{1, 2});
  CHECK(simulate(plan_1f1b({1, 4, 1})).peak_link_messages == std::vector<int>{0});
}

TEST_CASE("bad plans are named", "[schedule]") {
  // B before its F on the same rank.
  REQUIRE_THROWS_WITH(check_plan(plan_of("0B0 0F0\n", 1, 1)),
                      Catch::Contains("plan 'hand-written'") &&
                          Catch::Contains("0B0 comes before its forward 0F0"));
  // W before its B.
  REQUIRE_THROWS_WITH(check_plan(plan_of("0F0 0W0 0B0\n", 1, 1)),
                      Catch::Contains("0W0 comes before its backward 0B0"));
  // A missing action.
  REQUIRE_THROWS_WITH(check_plan(plan_of("0F0 0F1 0B0\n1F0 1F1 1B0 1B1\n", 2, 2)),
                      Catch::Contains("missing 0B1 (belongs on rank 0)"));
  REQUIRE_THROWS_WITH(check_plan(plan_of("0F0 0B0 0W0\n", 1, 2)),
                      Catch::Contains("missing 0F1") && Catch::Contains("more problems"));
  // A duplicate.
  REQUIRE_THROWS_WITH(
      check_plan(plan_of("0F0 0F0 0B0\n", 1, 1)),
      Catch::Contains("rank 0 position 1: duplicate 0F0 (first at rank 0 position 0)"));
  // A W in a non-split plan.
  pipeline_plan with_w = plan_1f1b({1, 1, 1});
  with_w.ranks[0].push_back(W(0, 0));
  REQUIRE_THROWS_WITH(check_plan(with_w), Catch::Contains("0W0 is a W in a non-split plan"));
  // A split plan needs every W.
  REQUIRE_THROWS_WITH(check_plan(plan_of("0F0 0B0 0W0 0F1 0B1\n", 1, 2)),
                      Catch::Contains("missing 0W1"));
  // A virtual stage on the wrong rank.
  REQUIRE_THROWS_WITH(
      check_plan(plan_of("0F0 1F0 0B0\n1B0\n", 2, 1)),
      Catch::Contains("rank 0 position 1: 1F0 is on the wrong rank (virtual stage 1 runs "
                      "on rank 1)"));
  // Out of range, wrong number of rank lists.
  REQUIRE_THROWS_WITH(
      check_plan(plan_of("0F0 0F1 0B0\n", 1, 1)),
      Catch::Contains("0F1 is out of range (virtual stages 0..0, micro-batches 0..0)"));
  REQUIRE_THROWS_WITH(check_plan(plan_of("0F0 2F0\n1F0\n", 2, 1)),
                      Catch::Contains("2F0 is out of range"));
  REQUIRE_THROWS_WITH(check_plan(plan_of("0F0 0B0\n", 2, 1)),
                      Catch::Contains("plan has 1 rank lists, the shape has 2 ranks"));
  const simulation sim = simulate(plan_of("0B0 0F0 0F0\n", 1, 1));
  CHECK_FALSE(sim.ok());
  CHECK(sim.errors.size() == 2);
  CHECK_THROWS_WITH(simulate(plan_1f1b({1, 1, 1}), {1, -1, 1, 0}), Catch::Contains(">= 0"));
}

TEST_CASE("a cross-rank deadlock is reported rank by rank", "[schedule]") {
  // Rank 0 waits for 1B0 before sending 0F1; rank 1 wants 1F1 before it runs 1B0.
  const pipeline_plan plan = plan_of("0F0 0B0 0F1 0B1\n1F0 1F1 1B0 1B1\n", 2, 2);
  const simulation sim = simulate(plan);
  CHECK(sim.errors.empty());
  REQUIRE(sim.deadlock);
  CHECK(sim.deadlock_report ==
        "rank 0 is blocked at 0B0 (action 1 of 4), waiting for 1B0 (rank 1); "
        "rank 1 is blocked at 1F1 (action 1 of 4), waiting for 0F1 (rank 0)");
  REQUIRE_THROWS_WITH(check_plan(plan),
                      Catch::Contains("plan 'hand-written' deadlocks: rank 0 is blocked at 0B0") &&
                          Catch::Contains("waiting for 0F1 (rank 0)"));
  // The same order made consistent (rank 1 runs 1B0 first) is fine.
  CHECK(simulate(plan_of("0F0 0B0 0F1 0B1\n1F0 1B0 1F1 1B1\n", 2, 2)).ok());
}

TEST_CASE("schedules refuse shapes they cannot serve", "[schedule]") {
  REQUIRE_THROWS_WITH(plan_1f1b({4, 8, 2}), Catch::Contains("1f1b needs virtual_stages == 1"));
  REQUIRE_THROWS_WITH(plan_gpipe({4, 8, 2}), Catch::Contains("gpipe needs virtual_stages == 1"));
  REQUIRE_THROWS_WITH(plan_zb_h1({4, 8, 3}), Catch::Contains("zb_h1 needs virtual_stages == 1"));
  REQUIRE_THROWS_WITH(plan_interleaved_1f1b({4, 8, 1}),
                      Catch::Contains("interleaved_1f1b needs virtual_stages >= 2"));
  REQUIRE_THROWS_WITH(plan_interleaved_1f1b({4, 6, 2}),
                      Catch::Contains("micro_batches % ranks == 0 (got m=6, p=4)"));
  REQUIRE_THROWS_WITH(plan_1f1b({0, 8, 1}), Catch::Contains("ranks >= 1"));
  REQUIRE_THROWS_WITH(make_plan("interleaved_1f1b", {4, 6, 2}),
                      Catch::Contains("schedule 'interleaved_1f1b'") &&
                          Catch::Contains("micro_batches % ranks == 0"));
}

TEST_CASE("the registry builds and checks plans by name", "[schedule]") {
  const std::vector<std::string> names = schedule_names();
  for (const char* built_in : {"1f1b", "gpipe", "interleaved_1f1b", "zb_h1"}) {
    CHECK(has_schedule(built_in));
    CHECK(std::find(names.begin(), names.end(), built_in) != names.end());
  }
  CHECK(std::is_sorted(names.begin(), names.end()));
  REQUIRE_THROWS_WITH(make_plan("2f2b", {2, 2, 1}),
                      Catch::Contains("unknown pipeline schedule '2f2b'") &&
                          Catch::Contains("1f1b, gpipe, interleaved_1f1b, zb_h1"));

  // A user schedule: 1F1B with the backward split and each W right after its B.
  register_schedule("test_eager_w", [](const schedule_shape& shape) {
    pipeline_plan plan = plan_1f1b(shape);
    plan.name = "test_eager_w";
    plan.split_backward = true;
    for (auto& rank : plan.ranks) {
      std::vector<pipeline_action> out;
      for (const pipeline_action& a : rank) {
        out.push_back(a);
        if (a.kind == action_kind::backward) out.push_back(W(a.virtual_stage, a.micro_batch));
      }
      rank = out;
    }
    return plan;
  });
  CHECK(has_schedule("test_eager_w"));
  const pipeline_plan plan = make_plan("test_eager_w", {4, 8, 1});
  const simulation sim = simulate(plan, {1, 1, 1, 0});
  REQUIRE(sim.ok());
  // The gradient leaves after B, before W: the bubble is (p-1)(F+B) per rank, not (p-1)(F+B+W).
  CHECK(sim.makespan == Approx(3.0 * 8 + 3 * 2).margin(1e-12));

  // A broken user schedule is refused with the simulator's message.
  register_schedule("test_broken", [](const schedule_shape& shape) {
    pipeline_plan plan = plan_1f1b(shape);
    plan.name = "test_broken";
    plan.ranks[0].pop_back();
    return plan;
  });
  REQUIRE_THROWS_WITH(make_plan("test_broken", {2, 2, 1}),
                      Catch::Contains("schedule 'test_broken': plan 'test_broken': missing 0B1"));
  register_schedule("test_wrong_shape", [](const schedule_shape&) { return plan_1f1b({2, 2, 1}); });
  REQUIRE_THROWS_WITH(make_plan("test_wrong_shape", {4, 8, 1}),
                      Catch::Contains("another shape (p=2, m=2, v=1)"));
  REQUIRE_THROWS_WITH(register_schedule("", plan_gpipe), Catch::Contains("empty schedule name"));
  REQUIRE_THROWS_WITH(register_schedule("x", nullptr), Catch::Contains("no function"));
}

// Actors build plans from several threads while others register schedules. (The meson test
// timeout bounds this test; each thread does a fixed, small amount of work.)
TEST_CASE("the registry can be used from several threads", "[schedule]") {
  std::vector<std::thread> threads;
  std::vector<int> built(4, 0);
  for (size_t t = 0; t < built.size(); ++t) {
    threads.emplace_back([t, &built] {
      const std::string name = "test_thread_" + std::to_string(t);
      for (int i = 0; i < 20; ++i) {
        register_schedule(name, plan_gpipe);
        built[t] += make_plan(name, {2, 2, 1}).ranks.size() == 2;
        built[t] += make_plan("zb_h1", {3, 4, 1}).split_backward;
        built[t] += has_schedule("1f1b") && !schedule_names().empty();
      }
    });
  }
  for (std::thread& th : threads) th.join();
  CHECK(built == std::vector<int>(4, 60));
}

// Not run by default: prints the table and plans of docs/schedules.md.
//   build/tests/engine/test_schedule "[.table]"
TEST_CASE("print the bubble table for docs/schedules.md", "[.table]") {
  std::printf("| schedule | m=4 | m=8 | m=16 |\n|---|---|---|---|\n");
  for (const char* name : {"gpipe", "1f1b", "interleaved_1f1b", "zb_h1"}) {
    const bool interleaved = std::string(name) == "interleaved_1f1b";
    std::printf("| %s%s |", name, interleaved ? " (v=2)" : "");
    for (int m : {4, 8, 16}) {
      const double c = interleaved ? 0.5 : 1.0;  // per-chunk costs: half a stage
      const simulation sim = simulate(make_plan(name, {4, m, interleaved ? 2 : 1}), {c, c, c, 0});
      std::printf(" %.4f |", sim.bubble_fraction);
    }
    std::printf("\n");
  }
  std::printf("\n%s\n%s", format_plan(plan_1f1b({4, 8, 1})).c_str(),
              format_plan(plan_zb_h1({4, 8, 1})).c_str());
}
