// Trace files: the JSON round trip (every field, exactly) and the on-disk event shapes; read
// errors that name the file; summary figures against hand-computed ones for a two-stage 1F1B
// pipeline, a two-replica data-parallel run and ZeRO-style collectives overlapping compute.
#include "tests/engine/trace_test_util.hpp"

using namespace troupe::engine::trace;
using namespace troupe::engine::trace::test;

namespace {

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
    CHECK(x.virtual_stage == y.virtual_stage);
    CHECK(x.bytes == y.bytes);
  }
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
  zero_span.virtual_stage = 0;
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
    CHECK(text.find("overlap:") == std::string::npos);  // no collective spans
    CHECK(text.find("pipeline window 10.000 ms per step") != std::string::npos);
    CHECK(text.find("stage 0 · dp 0     12.000     8.000     4    1.000     4    2.000") !=
          std::string::npos);
    const auto j = nlohmann::json::parse(summary_json(s, t.meta));
    CHECK(j.at("measured_bubble").get<double>() == Approx(0.4));
    CHECK(j.at("dp_hidden_fraction").is_null());
    CHECK(j.at("overlap").empty());
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
  // h.1 [4.5,6.5] runs under replica 1's last W (the reducer serves both replicas); h.0
  // [6.5,8] starts when every replica's compute has ended.
  REQUIRE(s.overlap.size() == 2);
  CHECK(s.overlap[0].name == "all-reduce h.1");  // ordered by first start
  CHECK(s.overlap[0].hidden_fraction() == Approx(1));
  CHECK(s.overlap[1].total_us == Approx(1.5 * unit));
  CHECK(s.overlap[1].hidden_us == 0);

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

namespace {

// Two replicas of one rank with a ZeRO shard track each (rank 0, replica r), in units:
//   stage 0 · dp 0: compute [5,12] and [8,20] (overlapping: counted once), step 0; [30,40] step 1
//   stage 0 · dp 1: compute [0,10] step 0; [30,40] step 1
//   shard 0 · dp 0: reduce-scatter [0,10] step 0 (hidden 5: [5,10]; dp 1's compute does not
//                   count), all-gather [18,22] step 0 (hidden 2), all-gather [38,42] step 1
//                   (hidden 2)
//   shard 0 · dp 1: reduce-scatter [0,4] step 0 (hidden 4)
trace_file zero_trace() {
  builder b;
  b.trace.meta.schedule = "1f1b";
  b.trace.meta.replicas = 2;
  const int s0 = b.add_track(1, "stage 0 · dp 0", "stage", 0, 0);
  const int s1 = b.add_track(2, "stage 0 · dp 1", "stage", 0, 1);
  const int z0 = b.add_track(10, "zero shard 0 · dp 0", "collective", 0, 0);
  const int z1 = b.add_track(11, "zero shard 0 · dp 1", "collective", 0, 1);
  b.span(s0, "compute", "F", 5, 12, 0, 0, 0);
  b.span(s0, "compute", "B", 8, 20, 0, 0, 0);
  b.span(s1, "compute", "F", 0, 10, 0, 0, 0);
  for (const int t : {s0, s1}) b.span(t, "compute", "F", 30, 40, 1, 0, 0);
  b.span(z0, "collective", "reduce-scatter", 0, 10, 0);
  b.span(z0, "collective", "all-gather", 18, 22, 0);
  b.span(z0, "collective", "all-gather", 38, 42, 1);
  b.span(z1, "collective", "reduce-scatter", 0, 4, 0);
  return b.trace;
}

}  // namespace

TEST_CASE("summary: collective time overlapped by compute, per name", "[trace][summary]") {
  const trace_file t = zero_trace();
  const summary s = summarize(t);
  REQUIRE(s.overlap.size() == 2);
  const collective_overlap &rs = s.overlap[0], &ag = s.overlap[1];
  CHECK(rs.name == "reduce-scatter");  // starts first
  CHECK(rs.spans == 2);
  CHECK(rs.total_us == Approx(14 * unit));
  CHECK(rs.hidden_us == Approx(9 * unit));
  CHECK(ag.name == "all-gather");
  CHECK(ag.spans == 2);
  CHECK(ag.total_us == Approx(8 * unit));
  CHECK(ag.hidden_us == Approx(4 * unit));
  CHECK(ag.hidden_fraction() == Approx(0.5));
  CHECK(s.dp_comm_us == Approx(22 * unit));  // the dp figures are unchanged
  CHECK(format_summary(s, t.meta).find("overlap: reduce-scatter 14.00 ms, 64.3% hidden behind "
                                       "compute; all-gather 8.00 ms, 50.0% hidden\n") !=
        std::string::npos);
  const auto j = nlohmann::json::parse(summary_json(s, t.meta));
  REQUIRE(j.at("overlap").size() == 2);
  CHECK(j.at("overlap")[0].at("name") == "reduce-scatter");
  CHECK(j.at("overlap")[0].at("spans") == 2);
  CHECK(j.at("overlap")[0].at("total_us").get<double>() == Approx(14 * unit));
  CHECK(j.at("overlap")[0].at("hidden_us").get<double>() == Approx(9 * unit));
  CHECK(j.at("overlap")[0].at("hidden_fraction").get<double>() == Approx(9.0 / 14));

  SECTION("a collective 0-10 under compute 5-20 of its replica is half hidden") {
    trace_file one = t;
    std::erase_if(one.events, [](const event& e) {
      return e.category == "collective" && !(e.track == 10 && e.name == "reduce-scatter");
    });
    const summary o = summarize(one);
    REQUIRE(o.overlap.size() == 1);
    CHECK(o.overlap[0].hidden_fraction() == Approx(0.5));
  }
  SECTION("skip_steps leaves the warm-up step's collectives out") {
    const summary k = summarize(t, 1);
    REQUIRE(k.overlap.size() == 1);
    CHECK(k.overlap[0].name == "all-gather");
    CHECK(k.overlap[0].total_us == Approx(4 * unit));
    CHECK(k.overlap[0].hidden_fraction() == Approx(0.5));
  }
  SECTION("a collective track without a replica serves every replica of its rank") {
    trace_file any = t;
    builder b{any};
    const int reducer = b.add_track(12, "dp reducer 0", "collective", 0);
    b.span(reducer, "collective", "all-reduce", 8, 24, 0);  // dp 1 to 10, dp 0 to 20: 12 of 16
    const int other = b.add_track(13, "zero shard 1 · dp 0", "collective", 1, 0);
    b.span(other, "collective", "all-reduce", 1, 5, 0);  // no stage of rank 1 computes
    const summary a = summarize(b.trace);
    REQUIRE(a.overlap.size() == 3);
    CHECK(a.overlap[1].name == "all-reduce");
    CHECK(a.overlap[1].total_us == Approx(20 * unit));
    CHECK(a.overlap[1].hidden_us == Approx(12 * unit));
  }
}
