// Shared by the trace tests: a builder for hand-made traces, the two-stage 1F1B and the
// two-replica data-parallel traces whose figures the tests compute by hand, and small text
// helpers.
#pragma once

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

#include "engine/trace/trace.hpp"
#include "engine/trace/trace_render.hpp"
#include "engine/trace/trace_summary.hpp"
#include "tests/engine/engine_test_util.hpp"

namespace troupe::engine::trace::test {

using troupe::engine::test::error_message;
using troupe::engine::test::temp_dir;
using troupe::engine::test::write_file;

inline constexpr double unit = 1000;  // µs: the hand-computed traces count in milliseconds

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
    e.virtual_stage = stage;
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
inline trace_file pipeline_trace() {
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
inline trace_file dp_trace(bool collective_per_replica = false) {
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

inline std::string read_text(const std::filesystem::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

inline std::size_t count(const std::string& text, const std::string& needle) {
  std::size_t n = 0;
  for (auto at = text.find(needle); at != std::string::npos; at = text.find(needle, at + 1)) ++n;
  return n;
}

// A small well-formedness check (no XML parser in the build): every tag closes in order,
// attribute values are quoted, and '&' only starts one of the five predefined entities.

}  // namespace troupe::engine::trace::test
