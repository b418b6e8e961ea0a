// Message-flow traces: what `troupe train --trace FILE` records and `troupe trace` reads.
// In memory a trace is tracks (one per actor) and events; on disk it is Chrome trace-event
// JSON that opens in Perfetto (ui.perfetto.dev) and chrome://tracing.
//
// Invariants:
//  - Times are microseconds since the start of the run (steady clock), as doubles.
//  - Every event names its track; a span has dur_us >= 0.
//  - A flow is a pair (flow_out on the sender's track inside its "send" span, flow_in on the
//    receiver's track inside the span that consumes the message) with the same flow_id; the
//    pairs of one micro-batch follow it through the pipeline.
//  - Category names used by the engine: "compute" (name F, B or W), "wait", "send", "recv",
//    "collective", "optimizer", "step", "data". Summary and render rely on them.
//  - write_json then read_json gives back the same trace (tracks, events, metadata).
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

namespace troupe::engine::trace {

struct track {
  int id = 0;
  std::string name;  // e.g. "stage 1 · dp 0"
  std::string role;  // "stage", "loader", "schedule", "coordinator", "collective"
  int rank = -1;     // pipeline rank, for stage and collective tracks
  int replica = -1;  // data-parallel replica, for stage and loader tracks
};

enum class event_kind : unsigned char { span, instant, flow_out, flow_in };

struct event {
  event_kind kind = event_kind::span;
  int track = 0;
  std::string category;  // see above
  std::string name;      // "F", "B", "W", "activation", "gradient", "all-reduce h.3", ...
  double ts_us = 0;
  double dur_us = 0;          // spans only
  std::uint64_t flow_id = 0;  // flows only
  int step = -1;              // -1: not applicable
  int micro_batch = -1;
  int virtual_stage = -1;
  std::int64_t bytes = -1;
};

struct metadata {
  std::string schedule;
  int ranks = 1;                  // p
  int micro_batches = 1;          // m
  int virtual_stages = 1;         // v
  int replicas = 1;               // d
  double theory_bubble = -1;      // the simulator's bubble for the plan with the measured mean
                                  // F/B/W costs; -1 when unknown
  std::vector<std::string> plan;  // format_plan lines, one per rank
};

struct trace_file {
  metadata meta;
  std::vector<track> tracks;
  std::vector<event> events;
};

// Chrome trace-event JSON: {"traceEvents": [...], "displayTimeUnit": "ms",
// "otherData": {metadata}}. Track names become thread_name metadata events (pid 1, tid = id;
// role, rank and replica ride in its args). otherData also carries "format": "troupe-trace" and
// "version": 1. Perfetto pairs flow ends by (id, category, name): keep all three equal.
// Writes atomically (temporary file, then rename).
void write_json(const trace_file& trace, const std::filesystem::path& path);
// Throws std::runtime_error "<file>: <what>": missing file, invalid JSON, no traceEvents, another
// format or version, an event phase other than X/i/s/f/M, an event on a track without a
// thread_name.
trace_file read_json(const std::filesystem::path& path);

}  // namespace troupe::engine::trace
