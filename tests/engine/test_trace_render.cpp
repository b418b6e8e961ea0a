// The SVG timeline: structure and escaping, collective lanes, and a realistic ZB-H1 4-stage,
// 8-micro-batch, 2-replica trace (set TROUPE_TRACE_EXAMPLE=PATH.svg to write its timeline, as
// docs/img/timeline-example.svg was).
#include "tests/engine/trace_test_util.hpp"

using namespace troupe::engine::trace;
using namespace troupe::engine::trace::test;

namespace {

std::string xml_problem(const std::string& doc) {
  std::vector<std::string> open;
  for (std::size_t i = 0; i < doc.size(); ++i) {
    if (doc[i] == '&') {
      bool known = false;
      for (const char* entity : {"&lt;", "&gt;", "&amp;", "&quot;", "&apos;"})
        known |= doc.compare(i, std::strlen(entity), entity) == 0;
      if (!known) return "bare & at " + std::to_string(i);
    }
    if (doc[i] != '<') continue;
    const auto end = doc.find('>', i);
    if (end == std::string::npos) return "unclosed tag at " + std::to_string(i);
    const std::string tag = doc.substr(i + 1, end - i - 1);
    if (count(tag, "\"") % 2 != 0 || tag.find('<') != std::string::npos)
      return "bad tag <" + tag + ">";
    if (tag[0] == '/') {
      if (open.empty() || open.back() != tag.substr(1)) return "mismatched </" + tag + ">";
      open.pop_back();
    } else if (tag.back() != '/') {
      open.push_back(tag.substr(0, tag.find_first_of(" \n/")));
    }
    i = end;
  }
  return open.empty() ? "" : "unclosed <" + open.back() + ">";
}

// --- a realistic trace: the ZB-H1 order with varying costs and message latency ------------

struct sim_options {
  int replica = 0, step = 0;
  double start_ms = 0;
  double slow = 1;        // cost multiplier (the warm-up step is slower)
  double jitter = 0.08;   // relative spread of action costs
  double latency = 0.06;  // ms from a producer's end to its consumer's start
};

// ZB-H1's order for rank r (Qi et al., "Zero Bubble Pipeline Parallelism"): 1F1B's warm-up of
// p-1-r forwards, then F/B pairs where each B is followed by a W once more than r are deferred,
// then the deferred W fill the drain. Kinds: 0 F, 1 B, 2 W.
std::vector<std::pair<int, int>> zb_h1_order(int p, int m, int r) {
  std::vector<std::pair<int, int>> order;
  const int warmup = std::min(p - 1 - r, m);
  int forwards = 0, backwards = 0, weights = 0;
  const auto backward = [&] {
    order.push_back({1, backwards++});
    if (backwards - weights > r) order.push_back({2, weights++});
  };
  while (forwards < warmup) order.push_back({0, forwards++});
  while (forwards < m) {
    order.push_back({0, forwards++});
    backward();
  }
  while (backwards < m) backward();
  while (weights < m) order.push_back({2, weights++});
  return order;
}

// One replica's step: each rank runs its ZB-H1 list in order, an action starting when the rank
// is free and its input has arrived (F after the previous stage's F, B after the next stage's B,
// `latency` later). Costs vary a little per action (deterministic). Returns, per rank, the last
// compute end and the span of the last W.
struct replica_result {
  std::vector<double> compute_end;
  std::vector<std::pair<double, double>> last_weight;
};
replica_result simulate_replica(builder& b, const std::vector<int>& stage_tracks,
                                const sim_options& o) {
  const int p = static_cast<int>(stage_tracks.size()), m = 8;
  const auto cost = [&](int kind, int r, int j) {
    const double base[] = {r == p - 1 ? 1.1 : 1.0, 1.05, 0.8};  // the last F has the loss head
    const unsigned h = (static_cast<unsigned>(kind * 7919 + r * 104729 + j * 1299709 +
                                              o.replica * 15485863 + o.step * 32452843) *
                        2654435761u) >>
                       16;
    return o.slow * base[kind] * (1 + o.jitter * ((h % 1000) / 500.0 - 1));
  };
  std::vector<std::vector<double>> done(2 * p, std::vector<double>(m, -1));  // [kind * p + r][j]
  std::vector<std::vector<std::pair<int, int>>> orders;
  for (int r = 0; r < p; ++r) orders.push_back(zb_h1_order(p, m, r));
  std::vector<std::size_t> next(p, 0);
  std::vector<double> free_at(p, o.start_ms);
  replica_result result{std::vector<double>(p, 0), std::vector<std::pair<double, double>>(p)};
  for (bool progress = true; progress;) {
    progress = false;
    for (int r = 0; r < p; ++r) {
      if (next[r] == orders[r].size()) continue;
      const auto [kind, j] = orders[r][next[r]];
      double ready = free_at[r];
      if (kind == 0 && r > 0) {
        if (done[r - 1][j] < 0) continue;
        ready = std::max(ready, done[r - 1][j] + o.latency);
      } else if (kind == 1 && r < p - 1) {
        if (done[p + r + 1][j] < 0) continue;
        ready = std::max(ready, done[p + r + 1][j] + o.latency);
      }
      const double end = ready + cost(kind, r, j);
      const char* names[] = {"F", "B", "W"};
      b.span(stage_tracks[r], "compute", names[kind], ready, end, o.step, j, r);
      if (kind < 2) done[kind * p + r][j] = end;
      if (kind == 2 && j == m - 1) result.last_weight[r] = {ready, end};
      free_at[r] = result.compute_end[r] = end;
      ++next[r];
      progress = true;
    }
  }
  for (int r = 0; r < p; ++r) REQUIRE(next[r] == orders[r].size());  // no deadlock
  return result;
}

// 4 ranks, 8 micro-batches, 2 replicas, two steps (the first slower: warm-up). Gradients of each
// rank are reduced in two buckets once both replicas finished the matching part of their last W.
// The theory bubble is that of the same greedy schedule with exact costs and no latency.
trace_file zb_like_trace() {
  const int p = 4;
  builder ideal;
  std::vector<int> ideal_tracks;
  for (int r = 0; r < p; ++r) ideal_tracks.push_back(ideal.add_track(r, "", "stage", r, 0));
  simulate_replica(ideal, ideal_tracks, {0, 0, 0, 1, 0, 0});

  builder b;
  b.trace.meta = {"zb_h1", p, 8, 1, 2, summarize(ideal.trace).measured_bubble, {}};
  for (int r = 0; r < p; ++r) {
    std::string line = "rank " + std::to_string(r) + ":";
    for (const auto& [kind, j] : zb_h1_order(p, 8, r))
      line.append(" ").append(std::to_string(r)).append(1, "FBW"[kind]).append(std::to_string(j));
    b.trace.meta.plan.push_back(line);
  }
  std::vector<std::vector<int>> stages(2);
  std::vector<int> collectives;
  for (int replica = 0; replica < 2; ++replica)
    for (int r = 0; r < p; ++r)
      stages[replica].push_back(b.add_track(
          1 + replica * p + r, "stage " + std::to_string(r) + " · dp " + std::to_string(replica),
          "stage", r, replica));
  for (int r = 0; r < p; ++r)
    collectives.push_back(
        b.add_track(20 + r, "all-reduce rank " + std::to_string(r), "collective", r));
  double start = 0;
  for (int step = 0; step < 2; ++step) {
    std::vector<replica_result> replicas;
    for (int replica = 0; replica < 2; ++replica)
      replicas.push_back(simulate_replica(
          b, stages[replica], {replica, step, start, step == 0 ? 1.3 : 1.0, 0.08, 0.06}));
    double step_end = start;
    for (int r = 0; r < p; ++r) {
      double h1 = 0, h0 = 0;  // both replicas' halves of the last W done
      for (const auto& d : replicas) {
        h1 = std::max(h1, (d.last_weight[r].first + d.last_weight[r].second) / 2);
        h0 = std::max(h0, d.last_weight[r].second);
      }
      h0 = std::max(h0, h1 + 0.9);
      b.span(collectives[r], "collective", "all-reduce h.1", h1, h1 + 0.9, step).bytes = 9437184;
      b.span(collectives[r], "collective", "all-reduce h.0", h0, h0 + 0.7, step).bytes = 7340032;
      for (int d = 0; d < 2; ++d)
        b.span(stages[d][r], "wait", "dp", replicas[d].compute_end[r], h0 + 0.7, step);
      step_end = std::max(step_end, h0 + 0.7);
    }
    for (const auto& replica : stages)
      for (const int t : replica) b.span(t, "optimizer", "adamw", step_end, step_end + 0.4, step);
    start = step_end + 0.6;
  }
  return b.trace;
}

}  // namespace

TEST_CASE("render_svg draws one box per compute span of the chosen step", "[trace][render]") {
  const trace_file t = pipeline_trace();
  const std::string svg = render_svg(t);
  CHECK(svg.rfind("<svg", 0) == 0);
  CHECK(svg.size() > 7);
  CHECK(svg.substr(svg.size() - 7) == "</svg>\n");
  CHECK(xml_problem(svg) == "");
  CHECK(count(svg, "class=\"compute\"") == 8);  // step 1: the last complete step
  CHECK(count(svg, "class=\"window\"") == 2);   // one grey window per stage row
  CHECK(count(svg, "class=\"legend\"") >= 3);
  CHECK(svg.find("F forward") != std::string::npos);
  CHECK(svg.find("B backward") != std::string::npos);
  CHECK(svg.find("step 1") != std::string::npos);
  CHECK(svg.find("bubble measured 33.3%, theory 33.3%") != std::string::npos);
  CHECK(svg.find(">1</text>") != std::string::npos);  // micro-batch numbers inside the boxes
  CHECK(svg.find("stage 0 · dp 0") < svg.find("stage 1 · dp 0"));

  SECTION("an explicit step") {
    const std::string s0 = render_svg(t, {0, 800});
    CHECK(s0.find("step 0") != std::string::npos);
    CHECK(s0.find("width=\"800\"") != std::string::npos);
    CHECK(count(s0, "class=\"compute\"") == 8);
    CHECK(s0.find("bubble measured 45.5%") != std::string::npos);
    CHECK(error_message<std::invalid_argument>([&] {
            render_svg(t, {7, 800});
          }).find("step 7 has no compute spans (the trace has steps 0 to 1)") != std::string::npos);
  }
  SECTION("an incomplete last step is not the default") {
    trace_file cut = t;
    builder b{cut};
    b.span(4, "compute", "F", 40, 41, 2, 0, 0);  // step 2: one F, then the run stopped
    CHECK(render_svg(b.trace).find("step 1") != std::string::npos);
    CHECK(render_svg(b.trace, {2, 1400}).find("step 2") != std::string::npos);
  }
  SECTION("text from the trace is escaped") {
    trace_file odd = t;
    odd.tracks[1].name = "stage <1> & \"x\"";
    odd.meta.schedule = "my<schedule>";
    const std::string s = render_svg(odd);
    CHECK(xml_problem(s) == "");
    CHECK(s.find("stage &lt;1&gt; &amp; &quot;x&quot;") != std::string::npos);
    CHECK(s.find("<1>") == std::string::npos);
    CHECK(s.find("my&lt;schedule&gt;") != std::string::npos);
  }
  SECTION("no compute at all") {
    trace_file empty = t;
    empty.events.clear();
    CHECK(error_message<std::invalid_argument>([&] {
            render_svg(empty);
          }).find("no compute spans") != std::string::npos);
  }
}

TEST_CASE("render_svg puts collectives on a lane under the rows they serve", "[trace][render]") {
  const std::string svg = render_svg(dp_trace());
  CHECK(xml_problem(svg) == "");
  CHECK(count(svg, "class=\"compute\"") == 12);
  CHECK(count(svg, "class=\"collective\"") == 4);  // two spans, under both replicas' rows
  CHECK(svg.find("W weight gradient") != std::string::npos);
  CHECK(svg.find("data-parallel collective") != std::string::npos);
  const std::string per_replica = render_svg(dp_trace(true));
  CHECK(count(per_replica, "class=\"collective\"") == 4);  // each replica's own two
}

TEST_CASE("a realistic ZB-H1 trace: summary and timeline", "[trace][render]") {
  const trace_file t = zb_like_trace();
  const summary s = summarize(t, 1);
  CHECK(s.steps == 1);
  REQUIRE(s.stages.size() == 8);
  for (const auto& st : s.stages) {
    CHECK(st.forward_count == 8);
    CHECK(st.backward_count == 8);
    CHECK(st.weight_count == 8);
  }
  // W fills 1F1B's drain: well under 1F1B's (p-1)/(m+p-1) = 27%, but not zero.
  CHECK(s.measured_bubble > 0.02);
  CHECK(s.measured_bubble < 0.2);
  CHECK(s.dp_hidden_fraction > 0);
  CHECK(s.dp_hidden_fraction < 1);

  CHECK(t.meta.theory_bubble > 0);
  CHECK(t.meta.theory_bubble < s.measured_bubble);  // latency and jitter only add idle time
  const std::string svg = render_svg(t);
  CHECK(xml_problem(svg) == "");
  CHECK(count(svg, "class=\"compute\"") == 8 * 24);
  CHECK(count(svg, "class=\"collective\"") == 2 * 8);
  if (const char* out = std::getenv("TROUPE_TRACE_EXAMPLE")) {
    std::ofstream(out) << svg;
    std::filesystem::path json_path = out;
    write_json(t, json_path.replace_extension(".json"));
  }
}
