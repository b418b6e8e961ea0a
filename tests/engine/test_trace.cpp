// Trace files: the JSON round trip (every field, exactly) and the on-disk event shapes; read
// errors that name the file; summary figures against hand-computed ones for a two-stage 1F1B
// pipeline and a two-replica data-parallel run; the SVG timeline's structure and escaping; and a
// realistic ZB-H1 4-stage, 8-micro-batch, 2-replica trace (set TROUPE_TRACE_EXAMPLE=PATH.svg
// to write its timeline, as docs/img/timeline-example.svg was).
#include <catch2/catch.hpp>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <tuple>
#include <vector>

#include "engine/trace.hpp"
#include "engine/trace_render.hpp"
#include "engine/trace_summary.hpp"
#include "tests/engine/engine_test_util.hpp"

using namespace troupe::engine::trace;
using troupe::engine::test::error_message;
using troupe::engine::test::temp_dir;
using troupe::engine::test::write_file;

namespace {

constexpr double unit = 1000;  // µs: the hand-computed traces count in milliseconds

struct builder {
  trace_file trace;
  int add_track(int id, const std::string& name, const std::string& role, int rank = -1,
                int replica = -1) {
    trace.tracks.push_back({id, name, role, rank, replica});
    return id;
  }
  // A span from `start` to `end` in units.
  event& span(int track, const std::string& category, const std::string& name, double start,
              double end, int step = -1, int micro_batch = -1, int stage = -1) {
    event e;
    e.track = track;
    e.category = category;
    e.name = name;
    e.ts_us = start * unit;
    e.dur_us = (end - start) * unit;
    e.step = step;
    e.micro_batch = micro_batch;
    e.stage = stage;
    trace.events.push_back(e);
    return trace.events.back();
  }
};

// p=2, m=2 1F1B, F = 1 unit, B = 2 units. Step 0 (from t=0) is a warm-up whose first activation
// reaches stage 1 late (at 3); step 1 starts at t=20 and runs the ideal schedule:
//   step 0  stage 0: F0 [0,1] F1 [1,2] B0 [6,8] B1 [9,11]    window [0,11], busy 6, idle 5
//           stage 1: F0 [3,4] B0 [4,6] F1 [6,7] B1 [7,9]
//   step 1  stage 0: F0 [0,1] F1 [1,2] B0 [4,6] B1 [7,9]     window [20,29], busy 6, idle 3
//           stage 1: F0 [1,2] B0 [2,4] F1 [4,5] B1 [5,7]
// Both steps: window 20, busy 12 and idle 8 per stage, bubble 1 - 24/40 = 0.4; step 1 alone:
// bubble 1 - 12/18 = 1/3, which is also 1F1B's theory (p-1)/(m+p-1).
trace_file pipeline_trace() {
  builder b;
  b.trace.meta.schedule = "1f1b";
  b.trace.meta.ranks = 2;
  b.trace.meta.micro_batches = 2;
  b.trace.meta.theory_bubble = 1.0 / 3;
  b.add_track(0, "coordinator", "coordinator");
  const int s1 = b.add_track(3, "stage 1 · dp 0", "stage", 1, 0);  // listed first on purpose
  const int s0 = b.add_track(4, "stage 0 · dp 0", "stage", 0, 0);
  const int loader = b.add_track(7, "loader · dp 0", "loader", -1, 0);
  struct box {
    int track;
    const char* name;
    double start;
    int mb;
  };
  const std::vector<box> step0 = {{s0, "F", 0, 0}, {s0, "F", 1, 1}, {s0, "B", 6, 0},
                                  {s0, "B", 9, 1}, {s1, "F", 3, 0}, {s1, "B", 4, 0},
                                  {s1, "F", 6, 1}, {s1, "B", 7, 1}};
  const std::vector<box> step1 = {{s0, "F", 0, 0}, {s0, "F", 1, 1}, {s0, "B", 4, 0},
                                  {s0, "B", 7, 1}, {s1, "F", 1, 0}, {s1, "B", 2, 0},
                                  {s1, "F", 4, 1}, {s1, "B", 5, 1}};
  for (const auto& [step, boxes, offset] :
       {std::tuple(0, step0, 0.0), std::tuple(1, step1, 20.0)}) {
    b.span(loader, "data", "batch", offset - 0.5, offset, step);
    for (const auto& x : boxes) {
      const double length = std::string(x.name) == "F" ? 1 : 2;
      b.span(x.track, "compute", x.name, offset + x.start, offset + x.start + length, step, x.mb,
             x.track == s0 ? 0 : 1);
    }
    b.span(s0, "send", "activation", offset + 1, offset + 1.1, step, 0);
    b.span(s1, "wait", "activation", offset, offset + 1, step);
    b.span(s0, "optimizer", "adamw", offset + 12, offset + 13, step);
    b.span(s1, "optimizer", "adamw", offset + 12, offset + 13, step);
  }
  b.span(s0, "compute", "F", 40, 41);  // no step: not part of any window
  return b.trace;
}

// p=1, d=2, m=2 with split backward, all actions 1 unit except replica 1's second W (1.5):
//   replica 0: F0 [0,1] F1 [1,2] B0 [2,3] B1 [3,4] W0 [4,5] W1 [5,6]   then waits "dp" [6,8]
//   replica 1: same, but W1 [5,6.5]                                    then waits "dp" [6.5,8]
//   collective (rank 0, both replicas): h.1 [4.5,6.5], h.0 [6.5,8]: 3.5 units
// h.1 overlaps compute. Exposed = the wait of the replica that finished compute last = 1.5
// (replica 0's extra 0.5 is load imbalance), hidden = 1 - 1.5/3.5 = 4/7.
// Window [0,6.5]: busy 6 and 6.5, idle 0.5 and 0, bubble 1 - 12.5/13.
trace_file dp_trace(bool collective_per_replica = false) {
  builder b;
  b.trace.meta.schedule = "1f1b";
  b.trace.meta.micro_batches = 2;
  b.trace.meta.replicas = 2;
  const int r0 = b.add_track(1, "stage 0 · dp 0", "stage", 0, 0);
  const int r1 = b.add_track(2, "stage 0 · dp 1", "stage", 0, 1);
  for (const int t : {r0, r1}) {
    const char* names[] = {"F", "F", "B", "B", "W", "W"};
    for (int i = 0; i < 6; ++i) {
      const double end = (t == r1 && i == 5) ? 6.5 : i + 1;
      b.span(t, "compute", names[i], i, end, 0, i % 2, 0);
    }
    b.span(t, "wait", "dp", t == r0 ? 6 : 6.5, 8, 0);
  }
  if (collective_per_replica) {
    for (const int replica : {0, 1}) {
      const int c = b.add_track(10 + replica, "all-reduce rank 0 · dp " + std::to_string(replica),
                                "collective", 0, replica);
      b.span(c, "collective", "all-reduce h.1", 4.5, 6.5, 0);
      b.span(c, "collective", "all-reduce h.0", 6.5, 8, 0);
    }
  } else {
    const int c = b.add_track(10, "all-reduce rank 0", "collective", 0);
    b.span(c, "collective", "all-reduce h.1", 4.5, 6.5, 0).bytes = 4096;
    b.span(c, "collective", "all-reduce h.0", 6.5, 8, 0).bytes = 2048;
  }
  return b.trace;
}

void require_same(const trace_file& a, const trace_file& b) {
  CHECK(a.meta.schedule == b.meta.schedule);
  CHECK(a.meta.ranks == b.meta.ranks);
  CHECK(a.meta.micro_batches == b.meta.micro_batches);
  CHECK(a.meta.virtual_stages == b.meta.virtual_stages);
  CHECK(a.meta.replicas == b.meta.replicas);
  CHECK(a.meta.theory_bubble == b.meta.theory_bubble);
  CHECK(a.meta.plan == b.meta.plan);
  REQUIRE(a.tracks.size() == b.tracks.size());
  for (std::size_t i = 0; i < a.tracks.size(); ++i) {
    INFO("track " << i);
    CHECK(a.tracks[i].id == b.tracks[i].id);
    CHECK(a.tracks[i].name == b.tracks[i].name);
    CHECK(a.tracks[i].role == b.tracks[i].role);
    CHECK(a.tracks[i].rank == b.tracks[i].rank);
    CHECK(a.tracks[i].replica == b.tracks[i].replica);
  }
  REQUIRE(a.events.size() == b.events.size());
  for (std::size_t i = 0; i < a.events.size(); ++i) {
    INFO("event " << i);
    const event &x = a.events[i], &y = b.events[i];
    CHECK(x.kind == y.kind);
    CHECK(x.track == y.track);
    CHECK(x.category == y.category);
    CHECK(x.name == y.name);
    CHECK(x.ts_us == y.ts_us);
    CHECK(x.dur_us == y.dur_us);
    CHECK(x.flow_id == y.flow_id);
    CHECK(x.step == y.step);
    CHECK(x.micro_batch == y.micro_batch);
    CHECK(x.stage == y.stage);
    CHECK(x.bytes == y.bytes);
  }
}

std::string read_text(const std::filesystem::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

std::size_t count(const std::string& text, const std::string& needle) {
  std::size_t n = 0;
  for (auto at = text.find(needle); at != std::string::npos; at = text.find(needle, at + 1)) ++n;
  return n;
}

// A small well-formedness check (no XML parser in the build): every tag closes in order,
// attribute values are quoted, and '&' only starts one of the five predefined entities.
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

TEST_CASE("write_json then read_json gives back every field exactly", "[trace]") {
  trace_file t = pipeline_trace();
  t.meta.virtual_stages = 3;
  t.meta.replicas = 5;
  t.meta.theory_bubble = 0.1 + 0.2;
  t.meta.plan = {"rank 0: 0F0 0F1 0B0 0B1", "rank 1: 1F0 1B0 1F1 1B1"};
  t.tracks.push_back({42, "odd \"name\" <with> & \\ and\nnewline", "", -1, -1});  // no events
  event out;
  out.kind = event_kind::flow_out;
  out.track = 4;
  out.category = "flow";
  out.name = "activation";
  out.ts_us = 123456789.123456789;
  out.flow_id = 0xFFFFFFFFFFFFFFFFull;
  out.micro_batch = 1;
  out.bytes = std::int64_t{1} << 40;
  event in = out;
  in.kind = event_kind::flow_in;
  in.track = 3;
  in.ts_us = 1e-7;
  in.flow_id = std::uint64_t{1} << 60;
  event instant;
  instant.kind = event_kind::instant;
  instant.track = 0;
  instant.category = "step";
  instant.name = "step 1 done";
  instant.ts_us = 29000.000000000004;
  instant.step = 1;
  event zero_span;
  zero_span.track = 3;
  zero_span.category = "recv";
  zero_span.name = "gradient";
  zero_span.stage = 0;
  zero_span.bytes = 0;
  zero_span.micro_batch = 0;
  zero_span.step = 0;
  t.events.insert(t.events.end(), {out, in, instant, zero_span});

  temp_dir dir;
  const auto path = dir / "trace.json";
  write_json(t, path);
  CHECK_FALSE(std::filesystem::exists(dir / "trace.json.tmp"));
  require_same(t, read_json(path));

  SECTION("the file is Chrome trace-event JSON") {
    const auto j = nlohmann::json::parse(read_text(path));
    CHECK(j.at("displayTimeUnit") == "ms");
    CHECK(j.at("otherData").at("format") == "troupe-trace");
    CHECK(j.at("otherData").at("version") == 1);
    CHECK(j.at("otherData").at("schedule") == "1f1b");
    std::map<std::string, int> phases;
    std::map<int, int> sort_index;
    for (const auto& e : j.at("traceEvents")) {
      ++phases[e.at("ph").get<std::string>()];
      CHECK(e.at("pid") == 1);
      const std::string ph = e.at("ph");
      if (ph == "X") CHECK(e.contains("dur"));
      if (ph == "i") CHECK(e.at("s") == "t");
      if (ph == "s") CHECK(e.at("id").get<std::uint64_t>() == out.flow_id);
      if (ph == "f") {
        CHECK(e.at("bp") == "e");
        CHECK(e.at("id").get<std::uint64_t>() == in.flow_id);
      }
      if (ph == "X" && e.at("name") == "F" && e.contains("args")) {
        CHECK(e.at("args").contains("step"));
        CHECK(e.at("args").contains("micro_batch"));
        CHECK_FALSE(e.at("args").contains("bytes"));  // -1: left out
      }
      if (ph == "M" && e.at("name") == "thread_sort_index")
        sort_index[e.at("tid").get<int>()] = e.at("args").at("sort_index").get<int>();
    }
    CHECK(phases["M"] == 1 + 2 * static_cast<int>(t.tracks.size()));  // process + 2 per track
    CHECK(phases["s"] == 1);
    CHECK(phases["f"] == 1);
    CHECK(phases["i"] == 1);
    CHECK(sort_index.at(4) < sort_index.at(3));  // stage 0 above stage 1
    CHECK(sort_index.at(0) < sort_index.at(4));  // the coordinator on top
  }
}

TEST_CASE("read_json names the file and what is wrong with it", "[trace]") {
  temp_dir dir;
  const auto missing = dir / "no-such-trace.json";
  const std::string no_file = error_message<std::runtime_error>([&] { read_json(missing); });
  CHECK(no_file.rfind(missing.string() + ": ", 0) == 0);
  CHECK(no_file.find("no such file") != std::string::npos);

  const std::string meta = R"("otherData":{"format":"troupe-trace","version":1})";
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"{\"traceEvents\": [", "invalid JSON"},
      {"{" + meta + "}", "traceEvents"},
      {R"({"traceEvents":{},)" + meta + "}", "traceEvents"},
      {R"({"traceEvents":[]})", "not a troupe trace"},
      {R"({"traceEvents":[],"otherData":{"format":"troupe-trace","version":2}})", "version 2"},
      {R"({"traceEvents":[{"ph":"X","cat":"compute","name":"F","pid":1,"tid":7,"ts":0,"dur":1}],)" +
           meta + "}",
       "unknown track 7"},
      {R"({"traceEvents":[{"ph":"M","name":"thread_name","pid":1,"tid":7,"args":{"name":"s"}},)"
       R"({"ph":"X","name":"F","pid":1,"tid":7,"ts":0}],)" +
           meta + "}",
       "traceEvents[1]"},
      {R"({"traceEvents":[{"ph":"B","name":"F","pid":1,"tid":7,"ts":0}],)" + meta + "}",
       "unsupported event phase \"B\""},
  };
  for (const auto& [text, needle] : cases) {
    INFO(text);
    const auto path = dir / "bad.json";
    write_file(path, text);
    const std::string msg = error_message<std::runtime_error>([&] { read_json(path); });
    CHECK(msg.rfind(path.string() + ": ", 0) == 0);
    CHECK(msg.find(needle) != std::string::npos);
    CHECK(msg.find('\n') == std::string::npos);
  }
  const auto into_missing_dir = dir / "no-such-dir" / "trace.json";
  CHECK(error_message<std::runtime_error>([&] {
          write_json(pipeline_trace(), into_missing_dir);
        }).rfind(into_missing_dir.string() + ": ", 0) == 0);
}

TEST_CASE("summary: busy, idle and bubble of a two-stage 1F1B pipeline", "[trace][summary]") {
  const trace_file t = pipeline_trace();
  const summary s = summarize(t);
  CHECK(s.steps == 2);
  CHECK(s.skipped_steps == 0);
  CHECK(s.window_us == Approx(20 * unit));
  CHECK(s.measured_bubble == Approx(0.4));
  CHECK(s.theory_bubble == Approx(1.0 / 3));
  CHECK(s.dp_comm_us == 0);
  CHECK(s.dp_hidden_fraction == -1);
  REQUIRE(s.stages.size() == 2);
  CHECK(s.stages[0].name == "stage 0 · dp 0");  // sorted by rank, not by track order
  CHECK(s.stages[1].rank == 1);
  for (const auto& st : s.stages) {
    CHECK(st.busy_us == Approx(12 * unit));
    CHECK(st.idle_us == Approx(8 * unit));
    CHECK(st.forward_count == 4);
    CHECK(st.backward_count == 4);
    CHECK(st.weight_count == 0);
    CHECK(st.forward_us == Approx(4 * unit));
    CHECK(st.backward_us == Approx(8 * unit));
  }

  SECTION("skip_steps leaves the warm-up step out") {
    const summary k = summarize(t, 1);
    CHECK(k.steps == 1);
    CHECK(k.skipped_steps == 1);
    CHECK(k.window_us == Approx(9 * unit));
    CHECK(k.measured_bubble == Approx(1.0 / 3));
    CHECK(k.stages[0].idle_us == Approx(3 * unit));
    CHECK(k.stages[0].forward_count == 2);
    const summary none = summarize(t, 5);
    CHECK(none.steps == 0);
    CHECK(none.skipped_steps == 2);
    CHECK(none.measured_bubble == -1);
    CHECK(format_summary(none, t.meta).find("none") != std::string::npos);
  }
  SECTION("one step") {
    CHECK(summarize_step(t, 0).measured_bubble == Approx(1 - 12.0 / 22));
    CHECK(summarize_step(t, 1).measured_bubble == Approx(1.0 / 3));
    CHECK(summarize_step(t, 9).steps == 0);
  }
  SECTION("text and JSON") {
    const std::string text = format_summary(s, t.meta);
    CHECK(text.find("bubble: measured 40.0% · theory 33.3% (schedule 1f1b, p=2, m=2, v=1)") !=
          std::string::npos);
    CHECK(text.find("dp communication: none") != std::string::npos);
    CHECK(text.find("pipeline window 10.000 ms per step") != std::string::npos);
    CHECK(text.find("stage 0 · dp 0     12.000     8.000     4    1.000     4    2.000") !=
          std::string::npos);
    const auto j = nlohmann::json::parse(summary_json(s, t.meta));
    CHECK(j.at("measured_bubble").get<double>() == Approx(0.4));
    CHECK(j.at("dp_hidden_fraction").is_null());
    CHECK(j.at("stages").size() == 2);
    CHECK(j.at("stages")[1].at("busy_us").get<double>() == Approx(12 * unit));
  }
}

TEST_CASE("summary: data-parallel communication hidden behind compute", "[trace][summary]") {
  const trace_file t = dp_trace();
  const summary s = summarize(t);
  CHECK(s.steps == 1);
  CHECK(s.window_us == Approx(6.5 * unit));
  CHECK(s.measured_bubble == Approx(1 - 12.5 / 13));
  CHECK(s.stages[0].idle_us == Approx(0.5 * unit));
  CHECK(s.stages[1].idle_us == Approx(0));
  CHECK(s.stages[1].weight_count == 2);
  CHECK(s.stages[1].weight_us == Approx(2.5 * unit));
  CHECK(s.dp_comm_us == Approx(3.5 * unit));
  CHECK(s.dp_wait_us == Approx(3.5 * unit));
  CHECK(s.dp_exposed_us == Approx(1.5 * unit));
  CHECK(s.dp_hidden_fraction == Approx(4.0 / 7));
  CHECK(format_summary(s, t.meta).find(
            "dp communication: 3.50 ms, exposed 1.50 ms, hidden 57.1%") != std::string::npos);

  SECTION("a collective track per replica serves that replica only") {
    const summary r = summarize(dp_trace(true));
    CHECK(r.dp_comm_us == Approx(7 * unit));
    CHECK(r.dp_exposed_us == Approx(3.5 * unit));
    CHECK(r.dp_hidden_fraction == Approx(0.5));
  }
  SECTION("spans without a step belong to the step whose window they fall in") {
    trace_file p = pipeline_trace();
    builder b{p};
    const int c = b.add_track(30, "all-reduce", "collective");  // serves both stages
    b.span(c, "collective", "all-reduce", 11, 12);              // step 0 by time
    b.span(c, "collective", "all-reduce", 29, 31);              // step 1 by time
    b.span(4, "wait", "dp", 11, 11.5, 0);
    b.span(4, "wait", "dp", 29, 31, 1);
    const summary all = summarize(b.trace);
    CHECK(all.dp_comm_us == Approx(3 * unit));
    CHECK(all.dp_exposed_us == Approx(1.25 * unit));  // (0.5 + 2) / 2 ranks served
    CHECK(all.dp_hidden_fraction == Approx(1 - 1.25 / 3));
    const summary late = summarize(b.trace, 1);
    CHECK(late.dp_comm_us == Approx(2 * unit));
    CHECK(late.dp_hidden_fraction == Approx(0.5));
  }
  SECTION("exposure beyond the communication clamps to nothing hidden") {
    trace_file p = dp_trace();
    for (auto& e : p.events)
      if (e.name == "dp") e.dur_us *= 10;
    CHECK(summarize(p).dp_hidden_fraction == 0);
  }
}

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
